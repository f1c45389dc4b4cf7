// pim_device: a CHANNELS-channel nhil PIM device: CHANNELS pim_channel instances (CH_ID 0..N-1,
// each with its banks, global buffer, MAC units, accumulators and CFRs) on one command bus and
// one readback bus (docs/rtl-interface.md "Channels"). Same ports, handshake and parameters as
// pim_channel plus CHANNELS.
//
// Every channel sees every beat (cmd_data, cmd_valid broadcast) and decodes the instruction's
// channel field itself (ALL_CH: all channels; else channel ch), so all channels step through
// the same states in the same cycles: an all-channel MAC_AB runs in every channel's banks at
// once, an instruction for one channel keeps the others in step doing nothing. The readback
// beat is the OR of the channels' beats: a channel's lanes outside the slots it holds are zero
// (RD_ACC of ALL_CH returns device slots in slot order = channel order; RD_SBK comes from
// channel ch alone). Handshake and status come from channel 0 (identical in every channel,
// asserted in simulation); err_o is the OR.
`timescale 1ns / 1ps

module pim_device #(
    parameter int CHANNELS = 2,
    parameter int BANKS    = 16,
    parameter int ROWS     = 256,
    parameter int COLS     = 128,
    parameter int LANES    = 16,
    parameter int ACCS     = 4,
    parameter int GB_ELEMS = 128,
    parameter int DW       = LANES * 16
) (
    input  logic          clk,
    input  logic          rst_n,
    input  logic          cmd_valid,
    output logic          cmd_ready,
    input  logic [DW-1:0] cmd_data,
    output logic          rd_valid,
    input  logic          rd_ready,
    output logic [DW-1:0] rd_data,
    output logic          rd_last,
    output logic          busy_o,
    output logic          sync_o,
    output logic          eoc_o,
    output logic          err_o,
    input  logic          bd_clear,
    input  logic          bd_load
);
  logic [CHANNELS-1:0] c_ready, c_rd_valid, c_rd_last, c_busy, c_sync, c_eoc, c_err;
  logic [DW-1:0] c_rd_data[CHANNELS];

  for (genvar c = 0; c < CHANNELS; c++) begin : g_ch
    pim_channel #(
        .BANKS(BANKS),
        .ROWS(ROWS),
        .COLS(COLS),
        .LANES(LANES),
        .ACCS(ACCS),
        .GB_ELEMS(GB_ELEMS),
        .DW(DW),
        .CH_ID(c),
        .CHANNELS(CHANNELS)
    ) u_ch (
        .clk(clk),
        .rst_n(rst_n),
        .cmd_valid(cmd_valid),
        .cmd_ready(c_ready[c]),
        .cmd_data(cmd_data),
        .rd_valid(c_rd_valid[c]),
        .rd_ready(rd_ready),
        .rd_data(c_rd_data[c]),
        .rd_last(c_rd_last[c]),
        .busy_o(c_busy[c]),
        .sync_o(c_sync[c]),
        .eoc_o(c_eoc[c]),
        .err_o(c_err[c]),
        .bd_clear(bd_clear),
        .bd_load(bd_load)
    );
  end

  always_comb begin
    rd_data = '0;
    for (int c = 0; c < CHANNELS; c++) rd_data = rd_data | c_rd_data[c];
  end
  assign cmd_ready = c_ready[0];
  assign rd_valid = c_rd_valid[0];
  assign rd_last = c_rd_last[0];
  assign busy_o = c_busy[0];
  assign sync_o = c_sync[0];
  assign eoc_o = c_eoc[0];
  assign err_o = |c_err;

`ifndef SYNTHESIS
  // the channels run in lockstep by construction; a channel that leaves it is a design bug
  always_ff @(posedge clk) begin
    if (rst_n && ({c_ready, c_rd_valid, c_rd_last, c_busy, c_sync, c_eoc} !=
                  {{CHANNELS{c_ready[0]}}, {CHANNELS{c_rd_valid[0]}}, {CHANNELS{c_rd_last[0]}},
                   {CHANNELS{c_busy[0]}}, {CHANNELS{c_sync[0]}}, {CHANNELS{c_eoc[0]}}}))
      $error("pim_device: channels out of step (ready %b, rd_valid %b, rd_last %b, busy %b, sync %b, eoc %b)",
             c_ready, c_rd_valid, c_rd_last, c_busy, c_sync, c_eoc);
  end
`endif
endmodule
