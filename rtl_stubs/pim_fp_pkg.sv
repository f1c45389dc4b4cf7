// pim_fp_pkg: the MAC numerics contract of nhil (nhil/numerics/mac.py) in SystemVerilog.
//
//   bf16_mul   : bf16 x bf16 -> fp32, IEEE-754 round-to-nearest-even, subnormal inputs and
//                results kept (no flush to zero), overflow to +-inf, signed zeros.
//   f32_add    : fp32 + fp32 -> fp32, IEEE-754 RNE, subnormals, inf, signed-zero rules
//                (-0 + -0 = -0, x + -x = +0, inf + -inf = NaN).
//   f32_to_bf16: fp32 -> bf16 RNE (the RD_ACC bf16 read format), NaN -> 0x7FC0.
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

  function automatic logic [15:0] f32_to_bf16(input logic [31:0] x);
    /* verilator lint_off UNUSEDSIGNAL */
    logic [31:0] r;  // only the upper half is the result
    /* verilator lint_on UNUSEDSIGNAL */
    if ((x[30:23] == 8'hFF) && (x[22:0] != 23'd0)) return 16'h7FC0;
    r = x + 32'h0000_7FFF + {31'd0, x[16]};
    return r[31:16];
  endfunction

endpackage
