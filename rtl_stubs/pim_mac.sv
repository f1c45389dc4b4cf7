// pim_mac: one bank's MAC unit for one burst (nhil/numerics/mac.py, rules 1-4).
//   dot_o = fixed pairwise tree over the LANES products bf16(w_i) x bf16(a_i) in fp32
//           (level 1 adds lanes (0,1),(2,3),...; level 2 adds those pairs in order; ...)
//   acc_o = fp32(acc_i + dot_o)
// Purely combinational: the channel registers acc_o into the accumulator each cycle.
`timescale 1ns / 1ps

module pim_mac #(
    parameter int LANES = 16  // power of two
) (
    input  logic [LANES*16-1:0] w_i,    // lane i = bits [16i +: 16], bf16
    input  logic [LANES*16-1:0] a_i,    // lane i = bits [16i +: 16], bf16
    input  logic [        31:0] acc_i,  // fp32
    output logic [        31:0] dot_o,  // fp32 dot16 of this burst
    output logic [        31:0] acc_o   // fp32 acc_i + dot_o
);
  import pim_fp_pkg::*;

  // node i < LANES: product of lane i; node LANES+j = node[2j] + node[2j+1]; root = 2*LANES-2.
  // Computed in a function (local array) so no simulator sees a combinational self-loop.
  function automatic logic [31:0] dot_tree(input logic [LANES*16-1:0] w, input logic [LANES*16-1:0] a);
    /* verilator no_inline_task */
    logic [31:0] node[2*LANES-1];
    for (int i = 0; i < LANES; i++) node[i] = bf16_mul(w[16*i+:16], a[16*i+:16]);
    for (int j = 0; j < LANES - 1; j++) node[LANES+j] = f32_add(node[2*j], node[2*j+1]);
    return node[2*LANES-2];
  endfunction

  assign dot_o = dot_tree(w_i, a_i);
  assign acc_o = f32_add(acc_i, dot_o);

  initial begin
    if ((LANES & (LANES - 1)) != 0) $error("pim_mac: LANES must be a power of two");
  end
endmodule
