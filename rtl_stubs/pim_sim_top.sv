// pim_sim_top: simulation harness top used by nhil's cocotb testbenches (not part of the
// contract). It holds the channel under test (u_ch, ports forwarded unchanged) and the
// datapath probe (u_probe) so one build serves both the RtlTarget and the datapath unit
// tests, and the file-driven command-stream driver (u_drv, pim_stream_drv): while the
// driver is active it owns cmd_valid/cmd_data, otherwise the testbench drives them through
// the forwarded ports. The device under test is pim_device (CHANNELS pim_channel instances;
// one channel alone when CHANNELS = 1); parameters are passed through.
`timescale 1ns / 1ps

module pim_sim_top #(
    parameter int CHANNELS = 1,
    parameter int BANKS    = 16,
    parameter int ROWS     = 256,
    parameter int COLS     = 128,
    parameter int LANES    = 16,
    parameter int ACCS     = 4,
    parameter int GB_ELEMS = 128,
    parameter int DW       = LANES * 16
) (
    input  logic                clk,
    input  logic                rst_n,
    input  logic                cmd_valid,
    output logic                cmd_ready,
    input  logic [      DW-1:0] cmd_data,
    output logic                rd_valid,
    input  logic                rd_ready,
    output logic [      DW-1:0] rd_data,
    output logic                rd_last,
    output logic                busy_o,
    output logic                sync_o,
    output logic                eoc_o,
    output logic                err_o,
    input  logic                bd_clear,
    input  logic                bd_load,
    // stream driver (see pim_stream_drv)
    input  logic                drv_start,
    input  logic [        31:0] drv_nbeats,
    output logic                drv_done,
    output logic [         1:0] drv_status,
    output logic [        31:0] drv_nrd,
    // datapath probe (see pim_dp_probe)
    input  logic [        15:0] mul_a,
    input  logic [        15:0] mul_b,
    output logic [        31:0] mul_y,
    input  logic [        31:0] add_a,
    input  logic [        31:0] add_b,
    output logic [        31:0] add_y,
    input  logic [        31:0] fmul_a,
    input  logic [        31:0] fmul_b,
    output logic [        31:0] fmul_y,
    input  logic [        31:0] cvt_a,
    output logic [        15:0] cvt_y,
    input  logic [LANES*16-1:0] mac_w,
    input  logic [LANES*16-1:0] mac_a,
    input  logic [        31:0] mac_acc,
    output logic [        31:0] mac_dot,
    output logic [        31:0] mac_y,
    input  logic [         7:0] q_fmt,
    input  logic [    8*256-1:0] q_row,
    input  logic [         7:0] q_j,
    input  logic [       255:0] q_a,
    input  logic [        31:0] q_acc,
    output logic [       511:0] q_e,
    output logic [        31:0] q_c1,
    output logic [        31:0] q_c2,
    output logic [        31:0] q_m,
    output logic [         2:0] q_use,
    output logic [        31:0] q_dot,
    output logic [        31:0] q_t,
    output logic [        31:0] q_y
);
  logic drv_active, drv_valid, ch_cmd_valid;
  logic [DW-1:0] drv_data, ch_cmd_data;
  assign ch_cmd_valid = drv_active ? drv_valid : cmd_valid;
  assign ch_cmd_data  = drv_active ? drv_data : cmd_data;

  pim_stream_drv #(
      .DW(DW)
  ) u_drv (
      .clk(clk),
      .start(drv_start),
      .nbeats(drv_nbeats),
      .active(drv_active),
      .done(drv_done),
      .status(drv_status),
      .nrd(drv_nrd),
      .cmd_valid(drv_valid),
      .cmd_data(drv_data),
      .cmd_ready(cmd_ready),
      .rd_valid(rd_valid),
      .rd_ready(rd_ready),
      .rd_data(rd_data),
      .busy(busy_o)
  );

  pim_device #(
      .CHANNELS(CHANNELS),
      .BANKS(BANKS),
      .ROWS(ROWS),
      .COLS(COLS),
      .LANES(LANES),
      .ACCS(ACCS),
      .GB_ELEMS(GB_ELEMS),
      .DW(DW)
  ) u_dev (
      .clk(clk),
      .rst_n(rst_n),
      .cmd_valid(ch_cmd_valid),
      .cmd_ready(cmd_ready),
      .cmd_data(ch_cmd_data),
      .rd_valid(rd_valid),
      .rd_ready(rd_ready),
      .rd_data(rd_data),
      .rd_last(rd_last),
      .busy_o(busy_o),
      .sync_o(sync_o),
      .eoc_o(eoc_o),
      .err_o(err_o),
      .bd_clear(bd_clear),
      .bd_load(bd_load)
  );

  pim_dp_probe #(
      .LANES(LANES)
  ) u_probe (
      .mul_a(mul_a),
      .mul_b(mul_b),
      .mul_y(mul_y),
      .add_a(add_a),
      .add_b(add_b),
      .add_y(add_y),
      .fmul_a(fmul_a),
      .fmul_b(fmul_b),
      .fmul_y(fmul_y),
      .cvt_a(cvt_a),
      .cvt_y(cvt_y),
      .mac_w(mac_w),
      .mac_a(mac_a),
      .mac_acc(mac_acc),
      .mac_dot(mac_dot),
      .mac_y(mac_y),
      .q_fmt(q_fmt),
      .q_row(q_row),
      .q_j(q_j),
      .q_a(q_a),
      .q_acc(q_acc),
      .q_e(q_e),
      .q_c1(q_c1),
      .q_c2(q_c2),
      .q_m(q_m),
      .q_use(q_use),
      .q_dot(q_dot),
      .q_t(q_t),
      .q_y(q_y)
  );
endmodule
