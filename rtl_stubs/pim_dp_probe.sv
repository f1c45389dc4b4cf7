// pim_dp_probe: test harness top that exposes the datapath blocks of pim_fp_pkg / pim_wfetch /
// pim_wdec / pim_mac combinationally, so cocotb can check them against nhil.numerics on many
// vectors. Not part of the channel; only the RTL unit tests build it.
//   mul/add/fmul/cvt : bf16 x bf16, fp32 + fp32, fp32 x fp32, fp32 -> bf16
//   mac_*            : a bf16 burst (W_FMT 0) through pim_wdec and pim_mac
//   q_*              : a quantized burst: q_row holds a PROBE_BURSTS-burst bank row (burst b in
//                      bits [256b +: 256], row byte k in bits [8k +: 8]), q_fmt the W_FMT code,
//                      q_j the burst; the same fetch/decode/MAC as every bank of pim_channel.
//                      q_e = the 16 decoded elements as fp32, q_c1/q_c2/q_m and q_use =
//                      {use_m, use_c2, use_c1} the burst's scales, q_dot/q_t/q_y the MAC.
`timescale 1ns / 1ps

module pim_dp_probe #(
    parameter int LANES = 16,
    parameter int PROBE_BURSTS = 8
) (
    input  logic [                15:0] mul_a,
    input  logic [                15:0] mul_b,
    output logic [                31:0] mul_y,    // bf16 x bf16 -> fp32
    input  logic [                31:0] add_a,
    input  logic [                31:0] add_b,
    output logic [                31:0] add_y,    // fp32 + fp32
    input  logic [                31:0] fmul_a,
    input  logic [                31:0] fmul_b,
    output logic [                31:0] fmul_y,   // fp32 x fp32
    input  logic [                31:0] cvt_a,
    output logic [                15:0] cvt_y,    // fp32 -> bf16 (RD_ACC bf16 format)
    input  logic [        LANES*16-1:0] mac_w,
    input  logic [        LANES*16-1:0] mac_a,
    input  logic [                31:0] mac_acc,
    output logic [                31:0] mac_dot,  // dot16 (pairwise tree)
    output logic [                31:0] mac_y,    // mac_acc + dot16
    input  logic [                 7:0] q_fmt,
    input  logic [PROBE_BURSTS*256-1:0] q_row,
    input  logic [                 7:0] q_j,
    input  logic [               255:0] q_a,
    input  logic [                31:0] q_acc,
    output logic [               511:0] q_e,
    output logic [                31:0] q_c1,
    output logic [                31:0] q_c2,
    output logic [                31:0] q_m,
    output logic [                 2:0] q_use,
    output logic [                31:0] q_dot,
    output logic [                31:0] q_t,
    output logic [                31:0] q_y
);
  import pim_fp_pkg::*;

  assign mul_y  = lane_mul(dec_bf16(mul_a), mul_b);
  assign add_y  = f32_add(add_a, add_b);
  assign fmul_y = f32_mul(fmul_a, fmul_b);
  assign cvt_y  = f32_to_bf16(cvt_a);

  // ---------------------------------------------------------------- bf16 burst (W_FMT 0)
  /* verilator lint_off PINCONNECTEMPTY */
  pim_bmac #(
      .LANES(LANES)
  ) u_mac (
      .fmt(8'd0),
      .bf(mac_w),
      .ewin('0),
      .eshift('0),
      .rwin('0),
      .rshift('0),
      .hdr('0),
      .nib_hi(1'b0),
      .a_i(mac_a),
      .sa_i(32'd0),
      .acc_i(mac_acc),
      .lanes(),
      .c1_o(),
      .c2_o(),
      .m_o(),
      .use_o(),
      .dot_o(mac_dot),
      .t_o(),
      .acc_o(mac_y)
  );

  // ---------------------------------------------------------------- quantized burst (16 lanes)
  logic [63:0] idx;
  logic [3:0] ok;
  logic [4:0] es, rs;
  logic hi;
  /* verilator lint_off UNUSEDSIGNAL */
  logic valid;
  /* verilator lint_on UNUSEDSIGNAL */
  pim_wfetch #(
      .BURSTS(PROBE_BURSTS)
  ) u_fetch (
      .fmt(q_fmt),
      .j({8'd0, q_j}),
      .idx(idx),
      .ok(ok),
      .eshift(es),
      .rshift(rs),
      .nib_hi(hi),
      .valid(valid)
  );
  logic [255:0] x[4];
  always_comb for (int k = 0; k < 4; k++) x[k] = ok[k] ? q_row[256*int'(idx[16*k+:16])+:256] : '0;

  logic [16*LANE_W-1:0] ql;
  logic [31:0] sa;
  pim_asum #(
      .LANES(16)
  ) u_asum (
      .a_i(q_a),
      .sa_o(sa)
  );
  pim_bmac #(
      .LANES(16)
  ) u_bmac (
      .fmt(q_fmt),
      .bf(q_row[256*int'(q_j[2:0])+:256]),
      .ewin({x[1], x[0]}),
      .eshift(es),
      .rwin({x[3], x[2]}),
      .rshift(rs),
      .hdr(q_row[31:0]),
      .nib_hi(hi),
      .a_i(q_a),
      .sa_i(sa),
      .acc_i(q_acc),
      .lanes(ql),
      .c1_o(q_c1),
      .c2_o(q_c2),
      .m_o(q_m),
      .use_o(q_use),
      .dot_o(q_dot),
      .t_o(q_t),
      .acc_o(q_y)
  );
  always_comb for (int i = 0; i < 16; i++) q_e[32*i+:32] = lane_to_f32(ql[LANE_W*i+:LANE_W]);
  /* verilator lint_on PINCONNECTEMPTY */
endmodule
