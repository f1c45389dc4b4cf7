// pim_dp_probe: test harness top that exposes the datapath blocks of pim_fp_pkg / pim_mac
// combinationally, so cocotb can check them against nhil.numerics on many vectors.
// Not part of the channel; only the RTL unit tests build it.
`timescale 1ns / 1ps

module pim_dp_probe #(
    parameter int LANES = 16
) (
    input  logic [        15:0] mul_a,
    input  logic [        15:0] mul_b,
    output logic [        31:0] mul_y,    // bf16 x bf16 -> fp32
    input  logic [        31:0] add_a,
    input  logic [        31:0] add_b,
    output logic [        31:0] add_y,    // fp32 + fp32
    input  logic [        31:0] cvt_a,
    output logic [        15:0] cvt_y,    // fp32 -> bf16 (RD_ACC bf16 format)
    input  logic [LANES*16-1:0] mac_w,
    input  logic [LANES*16-1:0] mac_a,
    input  logic [        31:0] mac_acc,
    output logic [        31:0] mac_dot,  // dot16 (pairwise tree)
    output logic [        31:0] mac_y     // mac_acc + dot16
);
  import pim_fp_pkg::*;

  assign mul_y = bf16_mul(mul_a, mul_b);
  assign add_y = f32_add(add_a, add_b);
  assign cvt_y = f32_to_bf16(cvt_a);

  pim_mac #(
      .LANES(LANES)
  ) u_mac (
      .w_i  (mac_w),
      .a_i  (mac_a),
      .acc_i(mac_acc),
      .dot_o(mac_dot),
      .acc_o(mac_y)
  );
endmodule
