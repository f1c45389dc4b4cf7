// pim_mac: one bank's MAC unit for one burst (nhil/numerics/mac.py rules 1-4 and
// docs/numerics.md "MAC with quantized weights").
//   dot_o = fixed pairwise tree over the LANES products fp32(w_i * a_i), w_i a decoded weight
//           lane (pim_wdec; bf16 weights decode exactly), a_i bf16 (level 1 adds lanes
//           (0,1),(2,3),...; level 2 adds those pairs in order; ...)
//   t_o   = dot_o; t_o = fp32(t_o * c1) if use_c1; t_o = fp32(t_o * c2) if use_c2;
//           t_o = fp32(t_o + fp32(sa_i * m)) if use_m (sa_i = dot16 of the activations alone)
//   acc_o = fp32(acc_i + t_o)
// Purely combinational: the channel registers acc_o into the accumulator each cycle.
`timescale 1ns / 1ps

module pim_mac #(
    parameter int LANES = 16  // power of two
) (
    input  logic [LANES*pim_fp_pkg::LANE_W-1:0] w_i,  // lane i = bits [LANE_W*i +: LANE_W]
    input  logic [LANES*16-1:0] a_i,    // lane i = bits [16i +: 16], bf16
    input  logic [        31:0] c1_i,   // fp32 scales / offset of the burst
    input  logic [        31:0] c2_i,
    input  logic [        31:0] m_i,
    input  logic                use_c1,
    input  logic                use_c2,
    input  logic                use_m,
    input  logic [        31:0] sa_i,   // dot16 of a_i alone (only read when use_m)
    input  logic [        31:0] acc_i,  // fp32
    output logic [        31:0] dot_o,  // fp32 dot16 of this burst
    output logic [        31:0] t_o,    // the burst's scaled contribution
    output logic [        31:0] acc_o   // fp32 acc_i + t_o
);
  import pim_fp_pkg::*;

  // node i < LANES: product of lane i; node LANES+j = node[2j] + node[2j+1]; root = 2*LANES-2.
  // Computed in a function (local array) so no simulator sees a combinational self-loop.
  function automatic logic [31:0] dot_tree(input logic [LANES*LANE_W-1:0] w, input logic [LANES*16-1:0] a);
    /* verilator no_inline_task */
    logic [31:0] node[2*LANES-1];
    for (int i = 0; i < LANES; i++) node[i] = lane_mul(w[LANE_W*i+:LANE_W], a[16*i+:16]);
    for (int j = 0; j < LANES - 1; j++) node[LANES+j] = f32_add(node[2*j], node[2*j+1]);
    return node[2*LANES-2];
  endfunction

  function automatic logic [31:0] scale(input logic [31:0] s, input logic [31:0] c1, input logic [31:0] c2, input logic [31:0] m,
                                        input logic u1, input logic u2, input logic um, input logic [31:0] sa);
    /* verilator no_inline_task */
    logic [31:0] t;
    t = s;
    if (u1) t = f32_mul(t, c1);
    if (u2) t = f32_mul(t, c2);
    if (um) t = f32_add(t, f32_mul(sa, m));
    return t;
  endfunction

  assign dot_o = dot_tree(w_i, a_i);
  assign t_o   = scale(dot_o, c1_i, c2_i, m_i, use_c1, use_c2, use_m, sa_i);
  assign acc_o = f32_add(acc_i, t_o);

  initial begin
    if ((LANES & (LANES - 1)) != 0) $error("pim_mac: LANES must be a power of two");
  end
endmodule
