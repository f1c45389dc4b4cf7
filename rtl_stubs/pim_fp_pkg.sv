// pim_fp_pkg: the MAC numerics contract of nhil (nhil/numerics/mac.py) in SystemVerilog.
//
//   bf16_mul   : bf16 x bf16 -> fp32, IEEE-754 round-to-nearest-even, subnormal inputs and
//                results kept (no flush to zero), overflow to +-inf, signed zeros.
//   f32_add    : fp32 + fp32 -> fp32, IEEE-754 RNE, subnormals, inf, signed-zero rules
//                (-0 + -0 = -0, x + -x = +0, inf + -inf = NaN).
//   f32_mul    : fp32 x fp32 -> fp32, IEEE-754 RNE (scales of quantized formats).
//   f32_to_bf16: fp32 -> bf16 RNE (the RD_ACC bf16 read format), NaN -> 0x7FC0.
//   dec_*, lane_mul: weight elements decoded into a MAC lane, lane x bf16 product.
// Every NaN produced is the canonical quiet NaN 0x7FC00000 (contract rule 4).
//
// `INJECT_RNE_BUG (define): f32_add rounds ties AWAY from zero instead of to even. It
// exists only for the negative test that proves the cross-target check catches a
// one-decision rounding bug. Never set it in a real build.
`timescale 1ns / 1ps

package pim_fp_pkg;

  localparam logic [31:0] F32_QNAN = 32'h7FC0_0000;
`ifdef INJECT_RNE_BUG
  localparam bit RNE_BUG = 1'b1;
`else
  localparam bit RNE_BUG = 1'b0;
`endif

  // Round (-1)^s * m * 2^e to fp32 with RNE; m != 0. tie_away: ties round away from zero.
  function automatic logic [31:0] f32_round_pack(input logic s, input int e, input logic [63:0] m,
                                                 input logic tie_away);
    /* verilator no_inline_task */
    int p, sh, shc, be;
    logic [63:0] q, lowmask, x;
    logic rnd, stk;
    longint bits;
    // p = index of the leading one of m (a 6-level priority encoder)
    p = 0;
    x = m;
    if (x[63:32] != 32'd0) begin p = p + 32; x = x >> 32; end
    if (x[31:16] != 16'd0) begin p = p + 16; x = x >> 16; end
    if (x[15:8] != 8'd0) begin p = p + 8; x = x >> 8; end
    if (x[7:4] != 4'd0) begin p = p + 4; x = x >> 4; end
    if (x[3:2] != 2'd0) begin p = p + 2; x = x >> 2; end
    if (x[1] != 1'b0) p = p + 1;
    // keep 24 significant bits, but never go below the subnormal LSB 2^-149
    sh = p - 23;
    if (sh < -149 - e) sh = -149 - e;
    if (sh > 0) begin
      shc = (sh > 65) ? 65 : sh;  // beyond 65 everything is below the round bit anyway
      q = m >> shc;
      rnd = ((m >> (shc - 1)) & 64'd1) != 64'd0;
      lowmask = (64'd1 << (shc - 1)) - 64'd1;  // shc-1 == 64 gives all ones
      stk = (m & lowmask) != 64'd0;
      if (rnd && (stk || q[0] || tie_away)) q = q + 64'd1;
    end else begin
      q = m << (-sh);
    end
    // LSB weight is 2^(e+sh) = 2^(be-150); (be-1)<<23 + q also covers the significand
    // carry-out (q == 2^24) and subnormal -> normal (q == 2^23, be == 1).
    be = e + sh + 150;
    bits = ((longint'(be) - 64'sd1) <<< 23) + longint'(q);
    if (bits >= 64'sh7F80_0000) return {s, 8'hFF, 23'd0};
    return {s, bits[30:0]};
  endfunction

  function automatic logic [31:0] bf16_mul(input logic [15:0] a, input logic [15:0] b);
    /* verilator no_inline_task */
    logic a_nan, b_nan, a_inf, b_inf, a_zero, b_zero, s;
    logic [7:0] sa, sb;
    logic [15:0] prod;
    int e;
    a_nan  = (a[14:7] == 8'hFF) && (a[6:0] != 7'd0);
    b_nan  = (b[14:7] == 8'hFF) && (b[6:0] != 7'd0);
    a_inf  = (a[14:7] == 8'hFF) && (a[6:0] == 7'd0);
    b_inf  = (b[14:7] == 8'hFF) && (b[6:0] == 7'd0);
    a_zero = a[14:0] == 15'd0;
    b_zero = b[14:0] == 15'd0;
    s = a[15] ^ b[15];
    if (a_nan || b_nan || (a_inf && b_zero) || (b_inf && a_zero)) return F32_QNAN;
    if (a_inf || b_inf) return {s, 8'hFF, 23'd0};
    if (a_zero || b_zero) return {s, 31'd0};
    // significand 8 bits (hidden bit unless subnormal); value = sig * 2^(eff_exp - 127 - 7)
    sa = {(a[14:7] != 8'd0), a[6:0]};
    sb = {(b[14:7] != 8'd0), b[6:0]};
    prod = 16'(sa) * 16'(sb);  // exact: at most 16 significant bits
    e = ((a[14:7] == 8'd0) ? 1 : int'(a[14:7])) + ((b[14:7] == 8'd0) ? 1 : int'(b[14:7])) - 268;
    return f32_round_pack(s, e, {48'd0, prod}, 1'b0);
  endfunction

  function automatic logic [31:0] f32_add(input logic [31:0] a, input logic [31:0] b);
    /* verilator no_inline_task */
    logic a_nan, b_nan, a_inf, b_inf;
    logic [31:0] big, sml;
    logic [63:0] wl, ws_full, ws, m;
    int el, es, d;
    logic lost;
    a_nan = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    b_nan = (b[30:23] == 8'hFF) && (b[22:0] != 23'd0);
    a_inf = (a[30:23] == 8'hFF) && (a[22:0] == 23'd0);
    b_inf = (b[30:23] == 8'hFF) && (b[22:0] == 23'd0);
    if (a_nan || b_nan || (a_inf && b_inf && (a[31] != b[31]))) return F32_QNAN;
    if (a_inf) return a;
    if (b_inf) return b;
    if (a[30:0] == 31'd0 && b[30:0] == 31'd0) return {a[31] & b[31], 31'd0};
    // order by magnitude ({exp, frac} orders like the value, subnormals included)
    if (a[30:0] >= b[30:0]) begin
      big = a;
      sml = b;
    end else begin
      big = b;
      sml = a;
    end
    el = (big[30:23] == 8'd0) ? 1 : int'(big[30:23]);
    es = (sml[30:23] == 8'd0) ? 1 : int'(sml[30:23]);
    d = el - es;
    if (d > 63) d = 63;
    // 24-bit significands with 26 guard bits below; the small one shifted, lost bits -> sticky
    wl = {14'd0, (big[30:23] != 8'd0), big[22:0], 26'd0};
    ws_full = {14'd0, (sml[30:23] != 8'd0), sml[22:0], 26'd0};
    ws = ws_full >> d;
    lost = (ws_full & ((64'd1 << d) - 64'd1)) != 64'd0;
    ws[0] = ws[0] | lost;
    m = (big[31] == sml[31]) ? wl + ws : wl - ws;
    if (m == 64'd0) return 32'd0;  // exact cancellation: +0 under RNE
    return f32_round_pack(big[31], el - 176, m, RNE_BUG);
  endfunction

  function automatic logic [31:0] f32_mul(input logic [31:0] a, input logic [31:0] b);
    /* verilator no_inline_task */
    logic a_nan, b_nan, a_inf, b_inf, a_zero, b_zero, s;
    logic [23:0] ma, mb;
    int e;
    a_nan  = (a[30:23] == 8'hFF) && (a[22:0] != 23'd0);
    b_nan  = (b[30:23] == 8'hFF) && (b[22:0] != 23'd0);
    a_inf  = (a[30:23] == 8'hFF) && (a[22:0] == 23'd0);
    b_inf  = (b[30:23] == 8'hFF) && (b[22:0] == 23'd0);
    a_zero = a[30:0] == 31'd0;
    b_zero = b[30:0] == 31'd0;
    s = a[31] ^ b[31];
    if (a_nan || b_nan || (a_inf && b_zero) || (b_inf && a_zero)) return F32_QNAN;
    if (a_inf || b_inf) return {s, 8'hFF, 23'd0};
    if (a_zero || b_zero) return {s, 31'd0};
    ma = {(a[30:23] != 8'd0), a[22:0]};
    mb = {(b[30:23] != 8'd0), b[22:0]};
    e = ((a[30:23] == 8'd0) ? 1 : int'(a[30:23])) + ((b[30:23] == 8'd0) ? 1 : int'(b[30:23])) - 300;
    return f32_round_pack(s, e, {16'd0, 48'(ma) * 48'(mb)}, 1'b0);
  endfunction

  // ---------------------------------------------------------------- decoded weight lanes
  // A weight element inside a MAC lane (docs/numerics.md "MAC with quantized weights"):
  // LANE_W bits {nan, inf, s, e[9:0] (two's complement), m[10:0]}, value (-1)^s * m * 2^e.
  // Every element format of nhil.numerics.formats (and bf16) is exact in it: at most 11
  // significant bits, exponents in [-133, 120]. lane_mul multiplies it by a bf16
  // activation with one RNE rounding, which equals fp32(e * a) of the contract.
  localparam int LANE_W = 24;
  localparam logic [LANE_W-1:0] LANE_NAN = {1'b1, 23'd0};
  localparam logic [LANE_W-1:0] LANE_ONE = {3'b000, 10'd0, 11'd1};

  /* verilator lint_off UNUSEDSIGNAL */
  function automatic logic [LANE_W-1:0] lane_num(input logic s, input int e, input int m);  // |m| < 2^11, e in [-512, 511]
    return {2'b00, s, 10'(e), 11'(m)};
  endfunction
  /* verilator lint_on UNUSEDSIGNAL */

  // Sign-magnitude minifloat code (ebits/mbits/bias; nank 0: no Inf/NaN, 1: only
  // all-ones exponent and mantissa is NaN (E4M3FN, UE4M3), 2: IEEE-like Inf/NaN).
  function automatic logic [LANE_W-1:0] dec_minifloat(input logic [15:0] c, input int eb, input int mb, input int bias,
                                                       input int nank, input logic signed_fmt);
    /* verilator no_inline_task */
    int ef, mf, emax;
    logic s;
    ef = (int'(c) >> mb) & ((1 << eb) - 1);
    mf = int'(c) & ((1 << mb) - 1);
    s = signed_fmt ? c[eb+mb] : 1'b0;
    emax = (1 << eb) - 1;
    if (nank == 2 && ef == emax) return (mf == 0) ? {2'b01, s, 21'd0} : LANE_NAN;
    if (nank == 1 && ef == emax && mf == (1 << mb) - 1) return LANE_NAN;
    if (ef == 0) return lane_num(s, 1 - bias - mb, mf);
    return lane_num(s, ef - bias - mb, (1 << mb) | mf);
  endfunction

  function automatic logic [LANE_W-1:0] dec_bf16(input logic [15:0] w);
    return dec_minifloat(w, 8, 7, 127, 2, 1'b1);
  endfunction

  // Integer element v * 2^e (|v| < 2^11).
  function automatic logic [LANE_W-1:0] dec_int(input int v, input int e);
    return lane_num(v < 0, e, (v < 0) ? -v : v);
  endfunction

  // A decoded lane as fp32 (exact): scales, and the datapath probe's view of the elements.
  function automatic logic [31:0] lane_to_f32(input logic [LANE_W-1:0] l);
    /* verilator no_inline_task */
    if (l[23]) return F32_QNAN;
    if (l[22]) return {l[21], 8'hFF, 23'd0};
    if (l[10:0] == 11'd0) return {l[21], 31'd0};
    return f32_round_pack(l[21], int'($signed(l[20:11])), {53'd0, l[10:0]}, 1'b0);
  endfunction

  // fp32(lane * bf16 a), RNE (exact unless it overflows or underflows).
  function automatic logic [31:0] lane_mul(input logic [LANE_W-1:0] w, input logic [15:0] a);
    /* verilator no_inline_task */
    logic a_nan, a_inf, a_zero, w_zero, s;
    logic [7:0] sa;
    int e;
    a_nan  = (a[14:7] == 8'hFF) && (a[6:0] != 7'd0);
    a_inf  = (a[14:7] == 8'hFF) && (a[6:0] == 7'd0);
    a_zero = a[14:0] == 15'd0;
    w_zero = !w[23] && !w[22] && (w[10:0] == 11'd0);
    s = w[21] ^ a[15];
    if (w[23] || a_nan || (w[22] && a_zero) || (a_inf && w_zero)) return F32_QNAN;
    if (w[22] || a_inf) return {s, 8'hFF, 23'd0};
    if (w_zero || a_zero) return {s, 31'd0};
    sa = {(a[14:7] != 8'd0), a[6:0]};
    e = int'($signed(w[20:11])) + ((a[14:7] == 8'd0) ? 1 : int'(a[14:7])) - 134;
    return f32_round_pack(s, e, {45'd0, 19'(w[10:0]) * 19'(sa)}, 1'b0);
  endfunction

  // ---------------------------------------------------------------- weight-format geometry
  // Where burst j (16 elements) of a bank row in weight format `code` (CFR W_FMT, docs/isa.md)
  // finds its bytes: the row holds header bytes, then per block its record bytes followed by
  // its packed element codes (nhil/numerics/formats/base.py "Row layout"). Returns
  // {valid, nib_hi, rec_off[15:0], elem_off[15:0]} (byte offsets in the row); nib_hi selects
  // the high nibbles of GGUF Q4 blocks (byte i = element i | element i+16 << 4).
  //   code  format            header  block  record  element bytes/burst  block bytes
  //   0x01  fp16                 0      16      0        32                  32
  //   0x02  int8 (row scale)     4      16      0        16                  16
  //   0x03/04 fp8-e4m3/e5m2      4      16      0        16                  16
  //   0x10-12 int4-g32/64/128    0   32/64/128  2         8            18/34/66
  //   0x13-15 ...-asym           0   32/64/128  3         8            19/35/67
  //   0x20/21/25/27 mx 8-bit     0      32      1        16                  33
  //   0x22/23 mxfp6              0      32      1        12                  25
  //   0x24/26 mxfp4              0      32      1         8                  17
  //   0x28  nvfp4                4      16      1         8                   9
  //   0x30  q8_0                 0      32      2        16                  34
  //   0x31/32 q4_0 / q4_1        0      32     2/4   16 (both halves)     18/20
  function automatic logic [33:0] wfmt_fetch(input logic [7:0] code, input int j);
    /* verilator no_inline_task */
    int hdr, lblk, rec, eb, bb, nb, q;
    logic [15:0] roff, eoff;
    logic gg, ok;
    hdr = 0;
    lblk = 1;
    rec = 1;
    eb = 16;
    bb = 33;
    gg = 1'b0;
    ok = 1'b1;
    case (code)
      8'h01: begin lblk = 0; rec = 0; eb = 32; bb = 32; end
      8'h02, 8'h03, 8'h04: begin hdr = 4; lblk = 0; rec = 0; bb = 16; end
      8'h10, 8'h11, 8'h12: begin lblk = int'(code) - 15; rec = 2; eb = 8; bb = 2 + (8 << lblk); end
      8'h13, 8'h14, 8'h15: begin lblk = int'(code) - 18; rec = 3; eb = 8; bb = 3 + (8 << lblk); end
      8'h20, 8'h21, 8'h25, 8'h27: ;
      8'h22, 8'h23: begin eb = 12; bb = 25; end
      8'h24, 8'h26: begin eb = 8; bb = 17; end
      8'h28: begin hdr = 4; lblk = 0; eb = 8; bb = 9; end
      8'h30: begin rec = 2; bb = 34; end
      8'h31: begin rec = 2; bb = 18; gg = 1'b1; end
      8'h32: begin rec = 4; bb = 20; gg = 1'b1; end
      default: ok = 1'b0;
    endcase
    if (!ok) return '0;  // bf16 or unknown: no fetch (addresses stay put outside quantized MACs)
    nb = j >> lblk;
    q = j & ((1 << lblk) - 1);
    roff = 16'(hdr + nb * bb);
    eoff = 16'(int'(roff) + rec + (gg ? 0 : q * eb));
    return {ok, gg && (q != 0), roff, eoff};
  endfunction

  function automatic logic [15:0] f32_to_bf16(input logic [31:0] x);
    /* verilator lint_off UNUSEDSIGNAL */
    logic [31:0] r;  // only the upper half is the result
    /* verilator lint_on UNUSEDSIGNAL */
    if ((x[30:23] == 8'hFF) && (x[22:0] != 23'd0)) return 16'h7FC0;
    r = x + 32'h0000_7FFF + {31'd0, x[16]};
    return r[31:16];
  endfunction

endpackage
