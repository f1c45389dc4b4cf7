// pim_bmac: one bank's weight decoder (pim_wdec) feeding its MAC unit (pim_mac) for one burst,
// the unit every bank of pim_channel has and pim_dp_probe exposes. Combinational.
//   inputs : the fetched row bytes of pim_wdec (bf, ewin/eshift, rwin/rshift, hdr, nib_hi) in
//            format fmt, the burst's bf16 activations a_i, their dot16 sa_i (pim_asum; GGUF
//            Q4_1's min term) and the accumulator acc_i
//   outputs: the decoded lanes and scales (pim_wdec), dot_o / t_o / acc_o (pim_mac)
`timescale 1ns / 1ps

module pim_bmac #(
    parameter int LANES = 16
) (
    input  logic [                         7:0] fmt,
    input  logic [                LANES*16-1:0] bf,
    input  logic [                       511:0] ewin,
    input  logic [                         4:0] eshift,
    input  logic [                       511:0] rwin,
    input  logic [                         4:0] rshift,
    input  logic [                        31:0] hdr,
    input  logic                                nib_hi,
    input  logic [                LANES*16-1:0] a_i,
    input  logic [                        31:0] sa_i,
    input  logic [                        31:0] acc_i,
    output logic [LANES*pim_fp_pkg::LANE_W-1:0] lanes,
    output logic [                        31:0] c1_o,
    output logic [                        31:0] c2_o,
    output logic [                        31:0] m_o,
    output logic [                         2:0] use_o,  // {use_m, use_c2, use_c1}
    output logic [                        31:0] dot_o,
    output logic [                        31:0] t_o,
    output logic [                        31:0] acc_o
);
  logic uc1, uc2, um_w;
  assign use_o = {um_w, uc2, uc1};
  pim_wdec #(
      .LANES(LANES)
  ) u_wdec (
      .fmt(fmt),
      .bf(bf),
      .ewin(ewin),
      .eshift(eshift),
      .rwin(rwin),
      .rshift(rshift),
      .hdr(hdr),
      .nib_hi(nib_hi),
      .lanes(lanes),
      .c1(c1_o),
      .c2(c2_o),
      .m(m_o),
      .use_c1(uc1),
      .use_c2(uc2),
      .use_m(um_w)
  );
  pim_mac #(
      .LANES(LANES)
  ) u_mac (
      .w_i(lanes),
      .a_i(a_i),
      .c1_i(c1_o),
      .c2_i(c2_o),
      .m_i(m_o),
      .use_c1(uc1),
      .use_c2(uc2),
      .use_m(um_w),
      .sa_i(sa_i),
      .acc_i(acc_i),
      .dot_o(dot_o),
      .t_o(t_o),
      .acc_o(acc_o)
  );
endmodule
