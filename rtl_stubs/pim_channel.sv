// pim_channel: one channel of the nhil PIM device (ISA v0), the RTL stub the real RTL drop
// replaces. Port list and handshake: docs/rtl-interface.md. Semantics of each opcode:
// docs/isa.md and nhil/targets/sim/device.py (the functional simulator); the MAC numerics:
// pim_fp_pkg / pim_mac (nhil/numerics/mac.py).
//
// Command stream (cmd_*): valid/ready, one DW-bit beat per transfer. A 16-byte ISA v0
// instruction word occupies bits [127:0] of a beat (byte 0 = bits [7:0]); data-in
// instructions are followed by their payload beats:
//   WR_GB, WR_ABK : n beats, one burst each (lane i = bits [16i +: 16], bf16)
//   WR_SBK        : 1 beat, one burst; lanes written where imm[i] = 1
//   WR_ACC        : ceil(n / (DW/32)) beats of fp32 values, slot col+j*(DW/32)+i in bits [32i +: 32]
// Readback stream (rd_*): valid/ready; RD_SBK gives n burst beats, RD_ACC gives
// ceil(n/(DW/32)) beats of fp32 (or bf16-rounded fp32 when CFR0 = 1); rd_last marks the
// last beat of an instruction. Unused lanes of the last RD_ACC beat are zero.
//
// One burst per clock: MAC_AB/MAC_SB/COPY_* take n cycles after the instruction beat; all
// banks' MAC units (pim_mac) work in parallel on MAC_AB.
//
// Weight formats (CFR 1 = W_FMT, docs/isa.md): with W_FMT != 0 a MAC reads its row as bytes
// in that format. For burst j the channel computes the byte offsets of the burst's element
// codes and block record (pim_fp_pkg::wfmt_fetch), reads the two bursts around each and the
// row's first burst (header) through the banks' open-row ports, and each bank's pim_bmac
// (pim_wdec + pim_mac) decodes its lanes and scales and accumulates. Quantized formats need LANES == 16.
//
// Channels (docs/rtl-interface.md "Channels"): channel CH_ID of a CHANNELS-channel device
// (pim_device) on a command bus shared by all channels. Every channel takes every beat and walks
// the same states for the same cycles; an instruction addresses this channel when ALL_CH is set
// or ch == CH_ID, otherwise it is skipped like a dropped one (beats consumed, nothing written,
// readback lanes zero) without err_o. RD_ACC/WR_ACC slots are device slots: with ALL_CH, slot
// s is bank s - CH_ID*BANKS of this channel; without, bank s of channel ch. The device ORs the
// channels' readback beats. With the defaults (CH_ID 0, CHANNELS 1) this is one channel alone.
`timescale 1ns / 1ps

module pim_channel #(
    parameter int BANKS    = 16,
    parameter int ROWS     = 256,
    parameter int COLS     = 128,  // bf16 elements per row
    parameter int LANES    = 16,   // MAC lanes = bf16 elements per burst
    parameter int ACCS     = 4,    // fp32 accumulators per bank
    parameter int GB_ELEMS = 128,  // bf16 elements in the global buffer
    parameter int DW       = LANES * 16,  // stream beat width; must equal LANES*16 (>= 128)
    parameter int CH_ID    = 0,  // this channel's index on the shared command bus
    parameter int CHANNELS = 1   // channels of the device (the ch field must be < CHANNELS)
) (
    input  logic          clk,
    input  logic          rst_n,      // synchronous, active low: clears GB, accumulators, CFR, FSM
    // command stream
    input  logic          cmd_valid,
    output logic          cmd_ready,
    input  logic [DW-1:0] cmd_data,
    // readback stream
    output logic          rd_valid,
    input  logic          rd_ready,
    output logic [DW-1:0] rd_data,
    output logic          rd_last,
    // status
    output logic          busy_o,     // an instruction is in flight (payload, execution or readback)
    output logic          sync_o,     // one-cycle pulse: SYNC accepted (all earlier work is complete)
    output logic          eoc_o,      // one-cycle pulse: EOC accepted
    output logic          err_o,      // sticky: an instruction was malformed or out of range (dropped)
    // simulation backdoor (pim_bank): clear all banks / $readmemh bank images
    input  logic          bd_clear,
    input  logic          bd_load
);
  import pim_fp_pkg::*;

  localparam int BURSTS = COLS / LANES;
  localparam int GB_BURSTS = GB_ELEMS / LANES;
  localparam int APB = DW / 32;  // accumulator values per beat
  localparam int AW = $clog2(ROWS * BURSTS);
  localparam int GBW = $clog2(GB_BURSTS);
  localparam int BKW = $clog2(BANKS);
  localparam int KW = $clog2(ACCS);

  // ISA v0 opcodes (nhil/isa/instr.py)
  localparam logic [7:0] OP_NOP = 8'h00, OP_WR_GB = 8'h01, OP_WR_ACC = 8'h02, OP_MAC_AB = 8'h03,
                         OP_MAC_SB = 8'h04, OP_RD_ACC = 8'h05, OP_WR_SBK = 8'h06, OP_RD_SBK = 8'h07,
                         OP_WR_ABK = 8'h08, OP_COPY_BK_GB = 8'h09, OP_COPY_GB_BK = 8'h0A,
                         OP_SET_CFR = 8'h0B, OP_SYNC = 8'h0C, OP_EOC = 8'h0D;
  localparam logic [7:0] FLAG_ALL_CH = 8'h01;

  typedef enum logic [1:0] {
    S_IDLE,
    S_PAY,
    S_EXEC,
    S_OUT
  } state_t;

  // ------------------------------------------------------------------ instruction fields
  logic [7:0] f_op, f_flags, f_ch, f_bank, f_k, f_rsv;
  logic [15:0] f_row, f_col, f_n, f_imm;
  assign f_op    = cmd_data[7:0];
  assign f_flags = cmd_data[15:8];
  assign f_ch    = cmd_data[23:16];
  assign f_bank  = cmd_data[31:24];
  assign f_row   = cmd_data[47:32];
  assign f_col   = cmd_data[63:48];
  assign f_n     = cmd_data[79:64];
  // cmd_data[95:80] is the operand index: host-side only, ignored by the device
  assign f_k     = cmd_data[103:96];
  assign f_rsv   = cmd_data[111:104];
  assign f_imm   = cmd_data[127:112];

`ifdef INJECT_CHANNEL_BUG
  localparam logic BUG_CH = CH_ID == 1;  // negative tests only: channel 1's MAC_AB leaves bank 3's accumulator as it was
`else
  localparam logic BUG_CH = 1'b0;
`endif

  // ------------------------------------------------------------------ state
  state_t st;
  logic [7:0] op_r;
  logic [BKW-1:0] bank_r;
  logic [15:0] row_r, col_r, n_r, imm_r, cnt, last;
  logic [KW-1:0] k_r;
  logic drop_r;  // malformed or not for this channel: consume its beats, write nothing, read zeros
  logic all_r;  // ALL_CH: RD_ACC/WR_ACC slots are device slots (this channel's start at CH_ID*BANKS)
  logic cfr_bf16;
  logic [7:0] wfmt;  // CFR 1 (W_FMT): 0 bf16, else a weight-format code
  logic [DW-1:0] gb[GB_BURSTS];
  logic [31:0] acc[BANKS][ACCS];

  // ------------------------------------------------------------------ banks
  logic [DW-1:0] bk_rdata[BANKS];
  logic [5*DW-1:0] bk_xdata[BANKS];
  logic [5*AW-1:0] bk_xaddr;
  logic [BANKS-1:0] bk_we;
  logic [LANES-1:0] bk_wmask;
  logic [AW-1:0] bk_waddr, bk_raddr;
  logic [DW-1:0] bk_wdata;

  int burst_i;
  /* verilator lint_off UNUSEDSIGNAL */
  int addr_i;  // truncated to AW bits (the host checks row/burst ranges)
  /* verilator lint_on UNUSEDSIGNAL */
  assign burst_i = int'(col_r) + int'(cnt);
  assign addr_i = int'(row_r) * BURSTS + burst_i;
  assign bk_raddr = AW'(addr_i);
  logic [GBW-1:0] gb_idx;
  assign gb_idx = GBW'(burst_i);

  wire pay_beat = (st == S_PAY) && cmd_valid;
  wire exec_cyc = (st == S_EXEC);

  always_comb begin
    bk_we = '0;
    bk_wmask = '1;
    bk_waddr = bk_raddr;
    bk_wdata = cmd_data;
    if (!drop_r) begin
      if (pay_beat && op_r == OP_WR_SBK) begin
        bk_we[bank_r] = 1'b1;
        bk_wmask = imm_r[LANES-1:0];
      end else if (pay_beat && op_r == OP_WR_ABK) begin
        bk_we = '1;
      end else if (exec_cyc && op_r == OP_COPY_GB_BK) begin
        bk_we[bank_r] = 1'b1;
        bk_wdata = gb[gb_idx];
      end
    end
  end

  for (genvar b = 0; b < BANKS; b++) begin : g_bank
    pim_bank #(
        .ROWS(ROWS),
        .BURSTS(BURSTS),
        .LANES(LANES),
        .BANK_ID(CH_ID * BANKS + b)
    ) u_bank (
        .clk(clk),
        .we(bk_we[b]),
        .wmask(bk_wmask),
        .waddr(bk_waddr),
        .wdata(bk_wdata),
        .raddr(bk_raddr),
        .rdata(bk_rdata[b]),
        .xaddr(bk_xaddr),
        .xdata(bk_xdata[b]),
        .bd_clear(bd_clear),
        .bd_load(bd_load)
    );
  end

  // ------------------------------------------------------------------ MAC units (one per bank)
  wire mac_cyc = exec_cyc && !drop_r && (op_r == OP_MAC_AB || op_r == OP_MAC_SB);
  logic [DW-1:0] mac_a;
  logic [31:0] mac_out[BANKS];
  logic [7:0] mac_fmt;
  assign mac_a = mac_cyc ? gb[gb_idx] : '0;  // inputs held at zero outside MAC cycles
  assign mac_fmt = mac_cyc ? wfmt : 8'd0;

  // open-row fetch of burst burst_i in format wfmt: element window, record window, header
  // (burst 0); bursts past the row read as zero
  logic [63:0] wf_idx;
  logic [3:0] wf_ok;
  logic [4:0] se, sr;
  logic nib_hi;
  /* verilator lint_off UNUSEDSIGNAL */
  logic wf_valid;  // checked when SET_CFR writes W_FMT
  int base_i;  // truncated to AW bits (the host checks row ranges)
  /* verilator lint_on UNUSEDSIGNAL */
  pim_wfetch #(
      .BURSTS(BURSTS)
  ) u_wfetch (
      .fmt(mac_fmt),
      .j(16'(burst_i)),
      .idx(wf_idx),
      .ok(wf_ok),
      .eshift(se),
      .rshift(sr),
      .nib_hi(nib_hi),
      .valid(wf_valid)
  );
  assign base_i = int'(row_r) * BURSTS;
  assign bk_xaddr = {AW'(base_i), AW'(base_i + int'(wf_idx[63:48])), AW'(base_i + int'(wf_idx[47:32])),
                     AW'(base_i + int'(wf_idx[31:16])), AW'(base_i + int'(wf_idx[15:0]))};

  // dot16 of the activations alone (GGUF Q4_1's min term): one more tree, shared by the banks
  logic [31:0] mac_sa;
  pim_asum #(
      .LANES(LANES)
  ) u_asum (
      .a_i(mac_fmt == 8'h32 ? mac_a : '0),
      .sa_o(mac_sa)
  );

  for (genvar b = 0; b < BANKS; b++) begin : g_mac
    logic [DW-1:0] x0, x1, x2, x3;
    logic [31:0] x4;  // the row header (bytes 0..3)
    assign x0 = wf_ok[0] ? bk_xdata[b][DW*0+:DW] : '0;
    assign x1 = wf_ok[1] ? bk_xdata[b][DW*1+:DW] : '0;
    assign x2 = wf_ok[2] ? bk_xdata[b][DW*2+:DW] : '0;
    assign x3 = wf_ok[3] ? bk_xdata[b][DW*3+:DW] : '0;
    assign x4 = bk_xdata[b][DW*4+:32];
    /* verilator lint_off PINCONNECTEMPTY */
    pim_bmac #(
        .LANES(LANES)
    ) u_bmac (
        .fmt(mac_fmt),
        .bf(mac_cyc ? bk_rdata[b] : '0),
        .ewin(512'({x1, x0})),
        .eshift(se),
        .rwin(512'({x3, x2})),
        .rshift(sr),
        .hdr(x4),
        .nib_hi(nib_hi),
        .a_i(mac_a),
        .sa_i(mac_sa),
        .acc_i(mac_cyc ? acc[b][k_r] : 32'd0),
        .lanes(),
        .c1_o(),
        .c2_o(),
        .m_o(),
        .use_o(),
        .dot_o(),
        .t_o(),
        .acc_o(mac_out[b])
    );
    /* verilator lint_on PINCONNECTEMPTY */
  end

  // ------------------------------------------------------------------ decode checks
  logic [15:0] beats_in;  // payload beats of the instruction in cmd_data
  logic [15:0] cycles;  // execution cycles / readback beats
  logic bad, all_ch, sel;
  int lim;
  assign all_ch = (f_flags & FLAG_ALL_CH) != 8'd0;
  assign sel = all_ch || int'(f_ch) == CH_ID;
  /* verilator lint_off UNUSEDSIGNAL */
  logic [33:0] imm_fmt;  // geometry of the W_FMT code a SET_CFR writes (only its valid bit is used)
  /* verilator lint_on UNUSEDSIGNAL */
  assign imm_fmt = wfmt_fetch(f_imm[7:0], 0);
  always_comb begin
    beats_in = 16'd0;
    cycles = f_n;
    lim = BURSTS;
    bad = (f_rsv != 8'd0) || (!all_ch && int'(f_ch) >= CHANNELS);
    case (f_op)
      OP_WR_GB: begin
        beats_in = f_n;
        lim = GB_BURSTS;
      end
      OP_WR_ABK: beats_in = f_n;
      OP_WR_SBK: beats_in = 16'd1;
      OP_WR_ACC: beats_in = 16'((int'(f_n) + APB - 1) / APB);
      OP_RD_ACC: cycles = 16'((int'(f_n) + APB - 1) / APB);
      OP_COPY_BK_GB, OP_COPY_GB_BK: lim = (BURSTS < GB_BURSTS) ? BURSTS : GB_BURSTS;
      default: ;
    endcase
    case (f_op)
      OP_NOP, OP_SYNC, OP_EOC: ;
      OP_SET_CFR:
      bad = bad || !((f_k == 8'd0 && f_imm <= 16'd1) ||
                     (f_k == 8'd1 && (f_imm == 16'd0 || (LANES == 16 && f_imm[15:8] == 8'd0 && imm_fmt[33]))));
      OP_WR_ACC, OP_RD_ACC:
      bad = bad || int'(f_k) >= ACCS || f_n == 16'd0 || int'(f_col) + int'(f_n) > (all_ch ? CHANNELS : 1) * BANKS;
      OP_WR_SBK:
      bad = bad || int'(f_bank) >= BANKS || int'(f_row) >= ROWS || int'(f_col) >= BURSTS;
      OP_WR_GB: bad = bad || f_n == 16'd0 || int'(f_col) + int'(f_n) > lim;
      OP_WR_ABK, OP_MAC_AB:
      bad = bad || f_n == 16'd0 || int'(f_row) >= ROWS || int'(f_col) + int'(f_n) > lim ||
            (f_op == OP_MAC_AB && int'(f_k) >= ACCS);
      OP_MAC_SB, OP_RD_SBK, OP_COPY_BK_GB, OP_COPY_GB_BK:
      bad = bad || f_n == 16'd0 || int'(f_row) >= ROWS || int'(f_bank) >= BANKS ||
            int'(f_col) + int'(f_n) > lim || (f_op == OP_MAC_SB && int'(f_k) >= ACCS) ||
            (f_op == OP_RD_SBK && all_ch);
      default: bad = 1'b1;  // reserved (EWMUL/EWADD/AF), HOST, unknown
    endcase
  end

  // ------------------------------------------------------------------ accumulator slots
  // bank of this channel holding lane j of the current RD_ACC/WR_ACC beat (slot col + cnt*APB + j)
  function automatic int slot_bank(input int j);
    return int'(col_r) + int'(cnt) * APB + j - (all_r ? CH_ID * BANKS : 0);
  endfunction
  function automatic logic acc_in(input int b);
    return b >= 0 && b < BANKS;
  endfunction

  // ------------------------------------------------------------------ readback data
  assign rd_valid = (st == S_OUT);
  assign rd_last = rd_valid && (cnt == last);
  always_comb begin
    rd_data = '0;
    if (!drop_r) begin
      if (op_r == OP_RD_SBK) rd_data = bk_rdata[bank_r];
      else begin
        for (int j = 0; j < APB; j++) begin
          if (int'(cnt) * APB + j < int'(n_r) && acc_in(slot_bank(j)))
            rd_data[32*j+:32] = cfr_bf16 ? {f32_to_bf16(acc[slot_bank(j)][k_r]), 16'd0} : acc[slot_bank(j)][k_r];
        end
      end
    end
  end

  assign cmd_ready = (st == S_IDLE) || (st == S_PAY);
  assign busy_o = (st != S_IDLE);

  // ------------------------------------------------------------------ FSM and registers
  always_ff @(posedge clk) begin
    sync_o <= 1'b0;
    eoc_o  <= 1'b0;
    if (!rst_n) begin
      st <= S_IDLE;
      cfr_bf16 <= 1'b0;
      wfmt <= 8'd0;
      err_o <= 1'b0;
      drop_r <= 1'b0;
      all_r <= 1'b0;
      cnt <= '0;
      for (int i = 0; i < GB_BURSTS; i++) gb[i] <= '0;
      for (int b = 0; b < BANKS; b++) for (int k = 0; k < ACCS; k++) acc[b][k] <= '0;
    end else begin
      case (st)
        S_IDLE:
        if (cmd_valid) begin
          op_r <= f_op;
          bank_r <= BKW'(f_bank);
          row_r <= f_row;
          col_r <= f_col;
          n_r <= f_n;
          imm_r <= f_imm;
          k_r <= KW'(f_k);
          drop_r <= bad || !sel;
          all_r <= all_ch;
          cnt <= '0;
          if (bad) err_o <= 1'b1;
          case (f_op)
            OP_WR_GB, OP_WR_ACC, OP_WR_SBK, OP_WR_ABK: begin
              last <= beats_in - 16'd1;
              if (beats_in != 16'd0) st <= S_PAY;
            end
            OP_MAC_AB, OP_MAC_SB, OP_COPY_BK_GB, OP_COPY_GB_BK: begin
              last <= cycles - 16'd1;
              if (!bad) st <= S_EXEC;
            end
            OP_RD_ACC, OP_RD_SBK: begin
              last <= cycles - 16'd1;
              if (cycles != 16'd0) st <= S_OUT;
            end
            OP_SET_CFR:
            if (!bad && sel) begin
              if (f_k == 8'd0) cfr_bf16 <= f_imm[0];
              else wfmt <= f_imm[7:0];
            end
            OP_SYNC: sync_o <= 1'b1;
            OP_EOC: eoc_o <= 1'b1;
            default: ;
          endcase
        end
        S_PAY:
        if (cmd_valid) begin
          if (!drop_r) begin
            if (op_r == OP_WR_GB) gb[gb_idx] <= cmd_data;
            if (op_r == OP_WR_ACC) begin
              for (int j = 0; j < APB; j++) begin
                if (int'(cnt) * APB + j < int'(n_r) && acc_in(slot_bank(j)))
                  acc[slot_bank(j)][k_r] <= cmd_data[32*j+:32];
              end
            end
          end
          cnt <= cnt + 16'd1;
          if (cnt == last) st <= S_IDLE;
        end
        S_EXEC: begin
          if (!drop_r) begin
            if (op_r == OP_MAC_AB) begin
              for (int b = 0; b < BANKS; b++) if (!(BUG_CH && b == 3)) acc[b][k_r] <= mac_out[b];
            end else if (op_r == OP_MAC_SB) begin
              acc[bank_r][k_r] <= mac_out[bank_r];
            end else if (op_r == OP_COPY_BK_GB) begin
              gb[gb_idx] <= bk_rdata[bank_r];
            end
          end
          cnt <= cnt + 16'd1;
          if (cnt == last) st <= S_IDLE;
        end
        S_OUT:
        if (rd_ready) begin
          cnt <= cnt + 16'd1;
          if (cnt == last) st <= S_IDLE;
        end
        default: st <= S_IDLE;
      endcase
    end
  end

  initial begin
    if (DW != LANES * 16 || DW < 128) $error("pim_channel: DW must equal LANES*16 and be >= 128");
    if (COLS % LANES != 0 || GB_ELEMS % LANES != 0) $error("pim_channel: COLS and GB_ELEMS must be multiples of LANES");
    if (BANKS < 2 || ACCS < 2) $error("pim_channel: BANKS and ACCS must be >= 2");
    if (CHANNELS < 1 || CHANNELS > 256 || CH_ID < 0 || CH_ID >= CHANNELS) $error("pim_channel: need 0 <= CH_ID < CHANNELS <= 256");
  end
endmodule
