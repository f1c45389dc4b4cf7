// pim_stream_drv: simulation-only command-stream driver of the test harness (pim_sim_top),
// not part of the channel contract. It plays a block of command beats from a file into the
// channel's command port with the documented valid/ready handshake and records every
// readback beat, at full simulator speed (the cocotb testbench only starts it and waits
// for done, instead of touching the ports every cycle).
//
//   <NHIL_STREAMDIR>/cmd.bin : nbeats beats of DW/8 bytes, most significant byte first
//   <NHIL_STREAMDIR>/rd.hex  : one line per readback beat, "%h" of rd_data (DW/4 digits)
//
// Handshake with the testbench: raise start with nbeats set; the driver opens the files at
// the next rising edge, offers beat 0, and moves to the next beat on every edge where
// cmd_valid && cmd_ready. When every beat was taken and the channel is idle (busy_o low)
// it raises done (status 0). Status 1: the channel waits for payload beats the block does
// not contain (beat-count mismatch); status 2: nothing moved for MAX_IDLE cycles (hang);
// status 3: cmd.bin is missing or short. done stays high until start is lowered.
`timescale 1ns / 1ps

module pim_stream_drv #(
    parameter int DW       = 256,
    parameter int MAX_IDLE = 1 << 22
) (
    input  logic          clk,
    input  logic          start,
    input  logic [  31:0] nbeats,
    output logic          active,     // the driver owns the command port
    output logic          done,
    output logic [   1:0] status,
    output logic [  31:0] nrd,        // readback beats recorded
    // channel ports
    output logic          cmd_valid,
    output logic [DW-1:0] cmd_data,
    input  logic          cmd_ready,
    input  logic          rd_valid,
    input  logic          rd_ready,
    input  logic [DW-1:0] rd_data,
    input  logic          busy
);
`ifndef SYNTHESIS
  string dir;
  int fin, fout, got;
  logic [31:0] sent, idle;
  logic [DW-1:0] beat;
  bit stopped;

  initial begin
    if (!$value$plusargs("NHIL_STREAMDIR=%s", dir)) dir = ".";
    active = 1'b0;
    done = 1'b0;
    status = 2'd0;
    nrd = '0;
    cmd_valid = 1'b0;
    cmd_data = '0;
    fin = 0;
    fout = 0;
  end

  task automatic stop_drv(input logic [1:0] st);
    stopped = 1'b1;
    if (fin != 0) $fclose(fin);
    if (fout != 0) $fclose(fout);
    fin = 0;
    fout = 0;
    cmd_valid <= 1'b0;
    active <= 1'b0;
    status <= st;
    done <= 1'b1;
  endtask

  // testbench process: file I/O and bookkeeping use blocking assignments on purpose
  /* verilator lint_off BLKSEQ */
  always @(posedge clk) begin
    if (!start) begin
      done <= 1'b0;
    end else if (!active && !done) begin
      fin = $fopen($sformatf("%s/cmd.bin", dir), "rb");
      fout = $fopen($sformatf("%s/rd.hex", dir), "w");
      sent = 0;
      idle = 0;
      nrd <= '0;
      if (fin == 0 || fout == 0) stop_drv(2'd3);
      else if (nbeats == 0) stop_drv(2'd0);
      else begin
        got = $fread(beat, fin);
        if (got != DW / 8) stop_drv(2'd3);
        else begin
          active <= 1'b1;
          cmd_valid <= 1'b1;
          cmd_data <= beat;
        end
      end
    end else if (active) begin
      stopped = 1'b0;
      idle = idle + 1;
      if (rd_valid && rd_ready) begin
        $fwrite(fout, "%h\n", rd_data);
        nrd <= nrd + 1;
        idle = 0;
      end
      if (cmd_valid && cmd_ready) begin  // a beat transfers at this edge
        sent = sent + 1;
        idle = 0;
        if (sent < nbeats) begin
          got = $fread(beat, fin);
          if (got != DW / 8) stop_drv(2'd3);
          else cmd_data <= beat;
        end else cmd_valid <= 1'b0;
      end else if (!cmd_valid && sent == nbeats) begin
        if (!busy) stop_drv(2'd0);
        else if (cmd_ready) stop_drv(2'd1);  // busy and ready: waiting for payload beats
      end
      if (!stopped && idle > MAX_IDLE) stop_drv(2'd2);
    end
  end
  /* verilator lint_on BLKSEQ */
`else
  assign active = 1'b0;
  assign done = 1'b0;
  assign status = 2'd0;
  assign nrd = '0;
  assign cmd_valid = 1'b0;
  assign cmd_data = '0;
`endif
endmodule
