// pim_wdec: weight decode of one bank's MAC lanes for one burst, in the format of CFR W_FMT
// (docs/numerics.md "MAC with quantized weights", nhil/numerics/formats/). Combinational.
//
// Inputs are the bytes the channel fetched from the open row (pim_fp_pkg::wfmt_fetch gives
// the offsets): the burst's element codes (ewin, starting at byte eshift), the block record
// (rwin, starting at byte rshift) and the row header (hdr, bytes 0..3 of the row); bf is
// the row's burst as bf16 lanes (W_FMT 0). Outputs are the decoded element of every lane
// (pim_fp_pkg LANE_W format, exact) and the burst's scales: c1 (block or row scale), c2
// (NVFP4 tensor scale), m (GGUF Q4_1 min), each fp32 and exact, with their use flags.
//
//   W_FMT  element e (lane i)                         c1                 c2        m
//   0x00   bf16 lane i                                -                  -         -
//   0x01   fp16 bytes [2i, 2i+2)                      -                  -         -
//   0x02   int8 byte i                                hdr fp32           -         -
//   0x03   E4M3FN byte i        0x04 E5M2 byte i      hdr fp32           -         -
//   0x10-2 nibble i - 8                               rec fp16           -         -
//   0x13-5 nibble i - rec[2] (zero point, u8)         rec fp16           -         -
//   0x20/27 E4M3FN, 0x21 E5M2, 0x25 int8 k * 2^-6     rec E8M0           -         -
//   0x22   E3M2, 0x23 E2M3 (6-bit stream, bits [6i, 6i+6))  rec E8M0     -         -
//   0x24/26 E2M1 nibble i                             rec E8M0           -         -
//   0x28   E2M1 nibble i                              rec UE4M3          hdr fp32  -
//   0x30   int8 byte i                                rec fp16 d         -         -
//   0x31   GGUF nibble - 8, 0x32 GGUF nibble          rec fp16 d         -         rec[2:3] fp16 (0x32)
// GGUF nibble = byte i, low half for the block's first burst, high half for the second.
//
// `INJECT_DECODE_BUG` (define, negative tests only): lane 5 decodes the E2M1 code 0x1 (0.5)
// as 1.0 (MXFP4, NVFP4); every other lane and format is unchanged.
`timescale 1ns / 1ps

module pim_wdec #(
    parameter int LANES = 16
) (
    input  logic [                     7:0] fmt,
    input  logic [            LANES*16-1:0] bf,
    input  logic [                   511:0] ewin,
    input  logic [                     4:0] eshift,
    input  logic [                   511:0] rwin,
    input  logic [                     4:0] rshift,
    input  logic [                    31:0] hdr,
    input  logic                            nib_hi,
    output logic [LANES*pim_fp_pkg::LANE_W-1:0] lanes,
    output logic [                    31:0] c1,
    output logic [                    31:0] c2,
    output logic [                    31:0] m,
    output logic                            use_c1,
    output logic                            use_c2,
    output logic                            use_m
);
  import pim_fp_pkg::*;

  localparam int QL = (LANES < 16) ? LANES : 16;  // lanes of a quantized burst (16 when LANES >= 16)
`ifdef INJECT_DECODE_BUG
  localparam int BUG_LANE = 5;
`else
  localparam int BUG_LANE = -1;
`endif

  logic [255:0] ew;
  logic [ 31:0] rw;
  assign ew = 256'(ewin >> {eshift, 3'b000});
  assign rw = 32'(rwin >> {rshift, 3'b000});

  function automatic logic [LANE_W-1:0] dec_e2m1(input logic [3:0] c, input int lane);
    if (lane == BUG_LANE && c[2:0] == 3'd1) return dec_minifloat({12'd0, c[3], 3'd2}, 2, 1, 1, 0, 1'b1);
    return dec_minifloat({12'd0, c}, 2, 1, 1, 0, 1'b1);
  endfunction

  // Element of lane i (i < 16) of a quantized burst.
  function automatic logic [LANE_W-1:0] dec_elem(input logic [7:0] f, input logic [255:0] e, input logic [7:0] z, input logic hi, input int i);
    /* verilator no_inline_task */
    logic [7:0] b;
    logic [3:0] nib, gnib;
    b = e[8*i+:8];
    nib = e[4*i+:4];
    gnib = hi ? b[7:4] : b[3:0];
    case (f)
      8'h01: return dec_minifloat(e[16*i+:16], 5, 10, 15, 2, 1'b1);
      8'h02, 8'h30: return dec_int(int'($signed(b)), 0);
      8'h25: return dec_int(int'($signed(b)), -6);
      8'h03, 8'h20, 8'h27: return dec_minifloat({8'd0, b}, 4, 3, 7, 1, 1'b1);
      8'h04, 8'h21: return dec_minifloat({8'd0, b}, 5, 2, 15, 2, 1'b1);
      8'h22: return dec_minifloat({10'd0, e[6*i+:6]}, 3, 2, 3, 0, 1'b1);
      8'h23: return dec_minifloat({10'd0, e[6*i+:6]}, 2, 3, 1, 0, 1'b1);
      8'h24, 8'h26, 8'h28: return dec_e2m1(nib, i);
      8'h10, 8'h11, 8'h12: return dec_int(int'(nib) - 8, 0);
      8'h13, 8'h14, 8'h15: return dec_int(int'(nib) - int'(z), 0);
      8'h31: return dec_int(int'(gnib) - 8, 0);
      8'h32: return dec_int(int'(gnib), 0);
      default: return '0;
    endcase
  endfunction

  // The whole burst is decoded in functions and assigned once (a lane-by-lane always_comb would
  // wake the MAC tree behind it once per lane in event-driven simulators such as Icarus).
  function automatic logic [LANES*LANE_W-1:0] dec_lanes(input logic [7:0] f, input logic [LANES*16-1:0] w, input logic [255:0] e,
                                                         input logic [7:0] z, input logic hi);
    /* verilator no_inline_task */
    logic [LANES*LANE_W-1:0] l;
    l = '0;
    if (f == 8'h00) begin
      for (int i = 0; i < LANES; i++) l[LANE_W*i+:LANE_W] = dec_bf16(w[16*i+:16]);
    end else begin
      for (int i = 0; i < QL; i++) l[LANE_W*i+:LANE_W] = dec_elem(f, e, z, hi, i);
    end
    return l;
  endfunction

  // {use_m, use_c2, use_c1, m, c2, c1}
  function automatic logic [98:0] dec_scales(input logic [7:0] f, input logic [31:0] r, input logic [31:0] h);
    /* verilator no_inline_task */
    case (f)
      8'h02, 8'h03, 8'h04: return {3'b001, 64'd0, h};
      8'h10, 8'h11, 8'h12, 8'h13, 8'h14, 8'h15, 8'h30, 8'h31: return {3'b001, 64'd0, lane_to_f32(dec_minifloat(r[15:0], 5, 10, 15, 2, 1'b1))};
      8'h32: return {3'b101, lane_to_f32(dec_minifloat(r[31:16], 5, 10, 15, 2, 1'b1)), 32'd0, lane_to_f32(dec_minifloat(r[15:0], 5, 10, 15, 2, 1'b1))};
      8'h20, 8'h21, 8'h22, 8'h23, 8'h24, 8'h25, 8'h26, 8'h27:  // E8M0
      return {3'b001, 64'd0, (r[7:0] == 8'hFF) ? F32_QNAN : lane_to_f32(lane_num(1'b0, int'(r[7:0]) - 127, 1))};
      8'h28: return {3'b011, 32'd0, h, lane_to_f32(dec_minifloat({8'd0, r[7:0]}, 4, 3, 7, 1, 1'b0))};  // UE4M3 (bit 7 ignored), tensor scale
      default: return '0;
    endcase
  endfunction

  assign lanes = dec_lanes(fmt, bf, ew, rw[23:16], nib_hi);
  assign {use_m, use_c2, use_c1, m, c2, c1} = dec_scales(fmt, rw, hdr);
endmodule
