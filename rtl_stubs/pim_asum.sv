// pim_asum: dot16 of a burst's bf16 activations alone (every weight lane 1.0) through the MAC
// tree of pim_mac: the sa_i term of GGUF Q4_1 (docs/numerics.md), one per channel. Combinational.
`timescale 1ns / 1ps

module pim_asum #(
    parameter int LANES = 16
) (
    input  logic [LANES*16-1:0] a_i,
    output logic [        31:0] sa_o
);
  import pim_fp_pkg::*;

  logic [LANES*LANE_W-1:0] ones;
  always_comb for (int i = 0; i < LANES; i++) ones[LANE_W*i+:LANE_W] = LANE_ONE;
  /* verilator lint_off PINCONNECTEMPTY */
  pim_mac #(
      .LANES(LANES)
  ) u_tree (
      .w_i(ones),
      .a_i(a_i),
      .c1_i(32'd0),
      .c2_i(32'd0),
      .m_i(32'd0),
      .use_c1(1'b0),
      .use_c2(1'b0),
      .use_m(1'b0),
      .sa_i(32'd0),
      .acc_i(32'd0),
      .dot_o(sa_o),
      .t_o(),
      .acc_o()
  );
  /* verilator lint_on PINCONNECTEMPTY */
endmodule
