// pim_wfetch: where a quantized MAC finds burst j of a row in weight format fmt
// (pim_fp_pkg::wfmt_fetch gives the byte offsets). The element codes and the block record
// each lie in a window of two consecutive bursts of the row: idx[0..1] (elements) and
// idx[2..3] (record) are those burst indices in the row (idx[x] = bits [16x +: 16]), with
// ok[x] = 0 (read as zero, index forced to 0) for bursts past the row's BURSTS; eshift/rshift are the byte offsets inside
// the windows. The row header is always burst 0. Combinational; shared by pim_channel and the
// datapath probe.
`timescale 1ns / 1ps

module pim_wfetch #(
    parameter int BURSTS = 8
) (
    input  logic [ 7:0] fmt,
    input  logic [15:0] j,
    output logic [63:0] idx,
    output logic [ 3:0] ok,
    output logic [ 4:0] eshift,
    output logic [ 4:0] rshift,
    output logic        nib_hi,
    output logic        valid    // fmt is a known weight-format code
);
  import pim_fp_pkg::*;

  logic [33:0] wf;  // {valid, nib_hi, rec_off, elem_off}
  int pe, pr;
  assign wf = wfmt_fetch(fmt, int'(j));
  assign pe = int'(wf[15:0]) >> 5;
  assign pr = int'(wf[31:16]) >> 5;
  assign eshift = wf[4:0];
  assign rshift = wf[20:16];
  assign nib_hi = wf[32];
  assign valid = wf[33];
  always_comb begin
    ok[0] = pe < BURSTS;
    ok[1] = pe + 1 < BURSTS;
    ok[2] = pr < BURSTS;
    ok[3] = pr + 1 < BURSTS;
    idx[15:0]  = ok[0] ? 16'(pe) : 16'd0;
    idx[31:16] = ok[1] ? 16'(pe + 1) : 16'd0;
    idx[47:32] = ok[2] ? 16'(pr) : 16'd0;
    idx[63:48] = ok[3] ? 16'(pr + 1) : 16'd0;
  end
endmodule
