// pim_bank: one DRAM bank of a PIM channel, stored as ROWS*BURSTS bursts of LANES bf16.
// One write port (lane-masked), one asynchronous read port (address = row*BURSTS + burst),
// and NX more asynchronous read ports into the same row (xaddr/xdata, packed NX-wide): the
// open-row reads a quantized MAC needs for a burst's element codes, block record and row
// header, which sit at byte offsets that are not burst-aligned (pim_fp_pkg::wfmt_fetch).
//
// Simulation backdoor (not synthesized, `ifndef SYNTHESIS): a bd_clear pulse zeroes the
// whole bank on the next clock edge; a bd_load pulse then loads the bank image from
// <NHIL_MEMDIR> (plusarg +NHIL_MEMDIR=<dir>, default "."):
//   binary (preferred, fast): bank<BANK_ID>.seg lists segments "<start> <count>" (decimal
//     burst addresses) and bank<BANK_ID>.bin holds their bursts back to back, each burst
//     BW/8 bytes, most significant byte first (lane LANES-1 first, big-endian bf16), read
//     with $fread(mem, fd, start, count);
//   hex (fallback when there is no .seg): bank<BANK_ID>.hex with $readmemh (one burst per
//     line, lane 0 in the low 16 bits, "@addr" lines give the burst address).
// Address = row*BURSTS + burst. See docs/rtl-interface.md "Backdoor load".
`timescale 1ns / 1ps

module pim_bank #(
    parameter int ROWS    = 256,
    parameter int BURSTS  = 8,   // bursts per row
    parameter int LANES   = 16,
    parameter int BANK_ID = 0,
    parameter int AW      = $clog2(ROWS * BURSTS),
    parameter int BW      = LANES * 16,
    parameter int NX      = 5
) (
    input  logic             clk,
    input  logic             we,
    input  logic [LANES-1:0] wmask,  // lane i written when wmask[i]
    input  logic [   AW-1:0] waddr,
    input  logic [   BW-1:0] wdata,
    input  logic [   AW-1:0] raddr,
    output logic [   BW-1:0] rdata,
    input  logic [NX*AW-1:0] xaddr,
    output logic [NX*BW-1:0] xdata,
    input  logic             bd_clear,  // simulation backdoor (see header)
    input  logic             bd_load
);
  localparam int DEPTH = ROWS * BURSTS;

  logic [BW-1:0] mem[DEPTH];
  logic [BW-1:0] bitmask;

  always_comb begin
    for (int i = 0; i < LANES; i++) bitmask[16*i+:16] = {16{wmask[i]}};
  end

  assign rdata = mem[raddr];
  for (genvar x = 0; x < NX; x++) begin : g_x
    assign xdata[BW*x+:BW] = mem[xaddr[AW*x+:AW]];
  end

`ifndef SYNTHESIS
  string memdir;
  initial begin
    if (!$value$plusargs("NHIL_MEMDIR=%s", memdir)) memdir = ".";
  end

  task automatic backdoor_load;
    int fseg, fbin, start, count, got;
    bit ok;
    fseg = $fopen($sformatf("%s/bank%0d.seg", memdir, BANK_ID), "r");
    if (fseg == 0) $readmemh($sformatf("%s/bank%0d.hex", memdir, BANK_ID), mem);
    else begin
      fbin = $fopen($sformatf("%s/bank%0d.bin", memdir, BANK_ID), "rb");
      ok = fbin != 0;
      if (!ok) $error("pim_bank %0d: %s/bank%0d.seg without .bin", BANK_ID, memdir, BANK_ID);
      while (ok && $fscanf(fseg, "%d %d\n", start, count) == 2) begin
        if (start < 0 || count <= 0 || start + count > DEPTH) begin
          $error("pim_bank %0d: segment [%0d, +%0d) outside %0d bursts", BANK_ID, start, count, DEPTH);
          ok = 0;
        end else begin
          got = $fread(mem, fbin, start, count);
          if (got != count * (BW / 8)) begin
            $error("pim_bank %0d: short image (%0d of %0d bytes at burst %0d)", BANK_ID, got, count * (BW / 8), start);
            ok = 0;
          end
        end
      end
      if (fbin != 0) $fclose(fbin);
      $fclose(fseg);
    end
  endtask
`endif

  always_ff @(posedge clk) begin
    if (we) mem[waddr] <= (mem[waddr] & ~bitmask) | (wdata & bitmask);
`ifndef SYNTHESIS
    if (bd_clear) begin
      for (int i = 0; i < DEPTH; i++) mem[i] <= '0;
    end
    if (bd_load) backdoor_load();
`else
    if (bd_clear || bd_load) begin
    end
`endif
  end
endmodule
