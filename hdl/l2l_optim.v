// SPDX-License-Identifier: Apache-2.0
// l2l_optim: the FPGA optimizer kernel of the Eager Param Server.
//
// One step of golden.apply_rule (AdamW, Adam, SGD with momentum / nesterov /
// dampening) over n elements held in DRAM: reads fp32 param, m, v and the
// gradient (fp32, bf16 or fp16) over one AXI4 master, runs LANES lanes of
// the rule (l2l_optim_lane; default DATA_WIDTH/32, one fp32 beat per clock),
// and writes fp32 param,
// m, v and the bf16/fp16 working copy (or none) over the same master.
// Control is the Vitis HLS ap_ctrl_hs AXI4-Lite map (l2l_optim_ctrl, map in
// hdl/l2l_optim_regs.json).
//
// Element e of every stream sits in lane e % LANES of group e / LANES. An
// fp32 beat holds RATIO = DATA_WIDTH/32/LANES groups, a 16-bit beat (grad,
// copy) 2*RATIO. Width conversion: the read side selects group
// (issued % (2*RATIO)) of the head beat of each stream FIFO and pops a beat
// after its last group; the write side assembles the groups that leave the
// lanes into a beat per stream and pushes it when it is full (or at the last
// group, where the write strobe masks the rest). Fewer lanes than
// DATA_WIDTH/32 lose nothing while the kernel is memory bound: an element
// moves 14+ bytes each way, so a beat of DATA_WIDTH/8 bytes per clock feeds
// at most DATA_WIDTH/112 elements per clock (4.57 at 512 bits).
// The datapath issues one group per clock when every enabled read stream
// holds its beat and every write FIFO has room for all groups in flight
// (credit), so the fixed-latency pipeline never stalls (ce is always 1).
//
// Streams per optimizer: param and grad always; m for Adam/AdamW and for SGD
// with momentum != 0; v for Adam/AdamW; the copy when COPY_DTYPE != none.
//
// 8-bit state (MODE.STATE 8bit; golden.quantize, docs/NUMERICS.md): m and v
// are streams of 1-byte codes (a beat holds 4*RATIO groups) plus one stream
// of fp32 block scales each (one per QUANT_BLOCK elements; the reader runs
// that stream ahead). Before the lanes, l2l_optim_dequant turns code and
// block scale into fp32 (DEQUANT_LATENCY; p and g wait in delay lines, in
// both formats, so the lanes' schedule is one); after the lanes, one
// l2l_optim_quant per slot collects each block, finds its scale and encodes
// it while the next block fills (the issue credit counts the groups it holds).
// The "!= 0" tests of the rule (weight_decay, momentum) are evaluated on the
// register values: magnitude bits [30:0] non-zero, so -0.0 counts as zero
// and NaN as non-zero, as Python's `!= 0` does.
//
// Alignment: every pointer a run uses must be a multiple of DATA_WIDTH/8
// bytes; otherwise STATUS.MISALIGNED is set and the run ends at once without
// a single memory access. n = 0 ends at once. A SLVERR/DECERR response sets
// STATUS.AXI_ERROR, stops new requests, drains what was issued, then ends.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim #
(
    parameter DATA_WIDTH = 128,
    parameter ADDR_WIDTH = 64,
    parameter ID_WIDTH = 1,
    parameter AXIL_ADDR_WIDTH = 8,
    // beats of an fp32 stream per tile, and the longest burst
    parameter TILE_BEATS = 64,
    // stream FIFO depth in beats (power of two, >= 2 * TILE_BEATS)
    parameter FIFO_DEPTH = 2*TILE_BEATS,
    parameter STRB_WIDTH = (DATA_WIDTH/8),
    parameter LANES = (DATA_WIDTH/32)
)
(
    input  wire                        clk,
    input  wire                        rst,

    /*
     * AXI4-Lite slave: control
     */
    input  wire [AXIL_ADDR_WIDTH-1:0]  s_axil_awaddr,
    input  wire [2:0]                  s_axil_awprot,
    input  wire                        s_axil_awvalid,
    output wire                        s_axil_awready,
    input  wire [31:0]                 s_axil_wdata,
    input  wire [3:0]                  s_axil_wstrb,
    input  wire                        s_axil_wvalid,
    output wire                        s_axil_wready,
    output wire [1:0]                  s_axil_bresp,
    output wire                        s_axil_bvalid,
    input  wire                        s_axil_bready,
    input  wire [AXIL_ADDR_WIDTH-1:0]  s_axil_araddr,
    input  wire [2:0]                  s_axil_arprot,
    input  wire                        s_axil_arvalid,
    output wire                        s_axil_arready,
    output wire [31:0]                 s_axil_rdata,
    output wire [1:0]                  s_axil_rresp,
    output wire                        s_axil_rvalid,
    input  wire                        s_axil_rready,

    /*
     * AXI4 master: memory
     */
    output wire [ID_WIDTH-1:0]         m_axi_awid,
    output wire [ADDR_WIDTH-1:0]       m_axi_awaddr,
    output wire [7:0]                  m_axi_awlen,
    output wire [2:0]                  m_axi_awsize,
    output wire [1:0]                  m_axi_awburst,
    output wire                        m_axi_awlock,
    output wire [3:0]                  m_axi_awcache,
    output wire [2:0]                  m_axi_awprot,
    output wire                        m_axi_awvalid,
    input  wire                        m_axi_awready,
    output wire [DATA_WIDTH-1:0]       m_axi_wdata,
    output wire [STRB_WIDTH-1:0]       m_axi_wstrb,
    output wire                        m_axi_wlast,
    output wire                        m_axi_wvalid,
    input  wire                        m_axi_wready,
    input  wire [ID_WIDTH-1:0]         m_axi_bid,
    input  wire [1:0]                  m_axi_bresp,
    input  wire                        m_axi_bvalid,
    output wire                        m_axi_bready,
    output wire [ID_WIDTH-1:0]         m_axi_arid,
    output wire [ADDR_WIDTH-1:0]       m_axi_araddr,
    output wire [7:0]                  m_axi_arlen,
    output wire [2:0]                  m_axi_arsize,
    output wire [1:0]                  m_axi_arburst,
    output wire                        m_axi_arlock,
    output wire [3:0]                  m_axi_arcache,
    output wire [2:0]                  m_axi_arprot,
    output wire                        m_axi_arvalid,
    input  wire                        m_axi_arready,
    input  wire [ID_WIDTH-1:0]         m_axi_rid,
    input  wire [DATA_WIDTH-1:0]       m_axi_rdata,
    input  wire [1:0]                  m_axi_rresp,
    input  wire                        m_axi_rlast,
    input  wire                        m_axi_rvalid,
    output wire                        m_axi_rready,

    // the name HLS gives the kernel's interrupt output
    /* verilator lint_off SYMRSVDWORD */
    output wire                        interrupt
    /* verilator lint_on SYMRSVDWORD */
);

`include "l2l_optim_regs.vh"
// LANE_LATENCY: clocks from a group in to its results out, the lane's own schedule
// (l2l_optim_lane's LATENCY is the same localparam); the side band is delayed by it.
`include "fp_latency.vh"
`include "l2l_optim_lane_schedule.vh"
`include "l2l_optim_state8.vh"
localparam ISSUE_STAGES = 3;  // the FIFO heads' two registers and the lanes' input register (see "issue")
// issue to lane output: the input register, the decode of the 8-bit state, the lane
localparam PIPE_LATENCY = ISSUE_STAGES + DEQUANT_LATENCY + LANE_LATENCY;
localparam BEAT_LANES = DATA_WIDTH/32;          // fp32 elements per beat
localparam RATIO = BEAT_LANES/LANES;            // groups per fp32 beat
localparam SUB_W = $clog2(RATIO) + 2;           // group index in an 8-bit beat
// the groups of a beat, less one: fp32, 16-bit and 8-bit streams
localparam integer SUB32_I = RATIO - 1, SUB16_I = 2*RATIO - 1, SUB8_I = 4*RATIO - 1;
localparam [SUB_W-1:0] SUB32 = SUB32_I[SUB_W-1:0], SUB16 = SUB16_I[SUB_W-1:0], SUB8 = SUB8_I[SUB_W-1:0];
localparam integer BLOCK_GROUPS = QUANT_BLOCK / LANES;   // groups per block of the 8-bit state
localparam integer BGW = $clog2(BLOCK_GROUPS);
localparam integer LAST_BLOCK_GROUP_I = BLOCK_GROUPS - 1;
localparam [BGW-1:0] LAST_BLOCK_GROUP = LAST_BLOCK_GROUP_I[BGW-1:0];
localparam integer BSW = (BEAT_SHIFT > 0) ? BEAT_SHIFT : 1;  // block scale index in a beat
localparam LANE_SHIFT = $clog2(LANES);
localparam BEAT_SHIFT = $clog2(BEAT_LANES);
localparam GROUP_BITS = 32*LANES;
localparam BYTE_SHIFT = $clog2(STRB_WIDTH);
localparam FIFO_AW = $clog2(FIFO_DEPTH);
localparam [1:0] ST_IDLE = 2'd0, ST_SETUP = 2'd1, ST_RUN = 2'd2, ST_FINISH = 2'd3;

// check configuration
initial begin
    if (DATA_WIDTH < 64 || DATA_WIDTH > 512 || (DATA_WIDTH & (DATA_WIDTH-1)) != 0) begin
        $error("Error: DATA_WIDTH must be 64, 128, 256 or 512 (instance %m)");
        $finish;
    end
    if (LANES < 1 || LANES > BEAT_LANES || (LANES & (LANES-1)) != 0) begin
        $error("Error: LANES must be a power of two, 1 <= LANES <= DATA_WIDTH/32 (instance %m)");
        $finish;
    end
    if (PIPE_LATENCY > 254) begin
        $error("Error: PIPE_LATENCY %0d does not fit the 8-bit in-flight count (instance %m)", PIPE_LATENCY);
        $finish;
    end
    if (TILE_BEATS < 4 || TILE_BEATS > 256 || FIFO_DEPTH < 2*TILE_BEATS) begin
        $error("Error: need 4 <= TILE_BEATS <= 256 and FIFO_DEPTH >= 2*TILE_BEATS (instance %m)");
        $finish;
    end
end

// ---------------------------------------------------------------- control
wire ap_start;
reg ap_done_reg;
reg [1:0] state_reg;
reg [2:0] status_reg;  // bits STATUS_*_BIT of the register map
reg [63:0] cycles_reg;

wire [64*8-1:0] arg_pointers;
wire [64*4-1:0] arg_scale_pointers;
wire [31:0] arg_n, arg_mode;
wire [32*13-1:0] arg_scalars;

l2l_optim_ctrl #(
    .ADDR_WIDTH(AXIL_ADDR_WIDTH),
    .DATA_BYTES(STRB_WIDTH)
) ctrl_inst (
    .clk(clk), .rst(rst),
    .s_axil_awaddr(s_axil_awaddr), .s_axil_awprot(s_axil_awprot), .s_axil_awvalid(s_axil_awvalid),
    .s_axil_awready(s_axil_awready), .s_axil_wdata(s_axil_wdata), .s_axil_wstrb(s_axil_wstrb),
    .s_axil_wvalid(s_axil_wvalid), .s_axil_wready(s_axil_wready), .s_axil_bresp(s_axil_bresp),
    .s_axil_bvalid(s_axil_bvalid), .s_axil_bready(s_axil_bready), .s_axil_araddr(s_axil_araddr),
    .s_axil_arprot(s_axil_arprot), .s_axil_arvalid(s_axil_arvalid), .s_axil_arready(s_axil_arready),
    .s_axil_rdata(s_axil_rdata), .s_axil_rresp(s_axil_rresp), .s_axil_rvalid(s_axil_rvalid),
    .s_axil_rready(s_axil_rready),
    .interrupt(interrupt),
    .ap_start(ap_start), .ap_idle(state_reg == ST_IDLE), .ap_done(ap_done_reg), .ap_ready(ap_done_reg),
    .pointers(arg_pointers), .scale_pointers(arg_scale_pointers), .n(arg_n), .mode(arg_mode), .scalars(arg_scalars),
    .status({29'd0, status_reg}), .cycles(cycles_reg)
);

// arguments latched at ap_start
reg [64*12-1:0] ptr_reg;
reg [31:0] n_reg;
reg [1:0] opt_reg;
reg nesterov_reg;
reg [1:0] grad_dtype_reg, copy_dtype_reg;
reg mom_nonzero_reg, wd_nonzero_reg;
reg state8_reg;  // m and v as 8-bit codes and block scales

wire [30:0] s_weight_decay = arg_scalars[32*2 +: 31];
wire [30:0] s_momentum = arg_scalars[32*11 +: 31];

wire mode_sgd = (opt_reg == MODE_OPTIMIZER_SGD);
wire mode_adamw = (opt_reg == MODE_OPTIMIZER_ADAMW);
wire q8 = state8_reg;
// The streams a run moves, decoded from the mode at ap_start into registers (timing: they
// gate every FIFO pop and the credit, so they come straight from flip-flops).
wire arg_sgd = (arg_mode[MODE_OPTIMIZER_BIT +: 2] == MODE_OPTIMIZER_SGD);
wire arg_8bit = (arg_mode[MODE_STATE_BIT +: MODE_STATE_WIDTH] == MODE_STATE_8BIT);
wire arg_en_m = !arg_sgd || (s_momentum != 0);
reg en_m, en_v;      // m, v
reg en_c;            // the working copy
reg grad16;          // a 16-bit gradient
reg en_ms, en_vs;    // the block-scale streams of the 8-bit state

// groups of LANES elements; beats: BEAT_LANES fp32 elements, 2*BEAT_LANES 16-bit ones
/* verilator lint_off UNUSEDSIGNAL */
wire [32:0] groups_w = ({1'b0, n_reg} + (LANES - 1)) >> LANE_SHIFT;
wire [31:0] groups = groups_w[31:0];
wire [32:0] beats32_w = ({1'b0, n_reg} + (BEAT_LANES - 1)) >> BEAT_SHIFT;
wire [32:0] beats16_w = ({1'b0, n_reg} + (2*BEAT_LANES - 1)) >> (BEAT_SHIFT + 1);
wire [32:0] beats8_w = ({1'b0, n_reg} + (4*BEAT_LANES - 1)) >> (BEAT_SHIFT + 2);
wire [32:0] blocks_w = ({1'b0, n_reg} + (QUANT_BLOCK - 1)) >> $clog2(QUANT_BLOCK);
wire [31:0] blocks = blocks_w[31:0];
wire [32:0] beats_s_w = ({1'b0, blocks} + (BEAT_LANES - 1)) >> BEAT_SHIFT;
/* verilator lint_on UNUSEDSIGNAL */
wire [BEAT_SHIFT+2:0] rem8 = {1'b0, n_reg[BEAT_SHIFT+1:0]};
wire [BEAT_SHIFT:0] rem_s = {1'b0, blocks[BEAT_SHIFT-1:0]};
wire [BEAT_SHIFT:0] rem32 = {1'b0, n_reg[BEAT_SHIFT-1:0]};
wire [BEAT_SHIFT+1:0] rem16 = {1'b0, n_reg[BEAT_SHIFT:0]};
wire [31:0] rem_lane = n_reg & (LANES - 1);
// Each stream's beats and last write strobe, registered (timing: the engines load them at
// run_start, two clocks after n_reg, and their carry chains would otherwise run on into the
// engines' counters and compares)
reg [31:0] beats32, beats16, beats8, beats_s;
reg [STRB_WIDTH-1:0] strb32, strb16, strb8, strb_s;
always @(posedge clk) begin
    beats32 <= beats32_w[31:0];
    beats16 <= beats16_w[31:0];
    beats8 <= beats8_w[31:0];
    beats_s <= beats_s_w[31:0];
    strb32 <= (rem32 == 0) ? {STRB_WIDTH{1'b1}} : ~({STRB_WIDTH{1'b1}} << (4*rem32));
    strb16 <= (rem16 == 0) ? {STRB_WIDTH{1'b1}} : ~({STRB_WIDTH{1'b1}} << (2*rem16));
    strb8 <= (rem8 == 0) ? {STRB_WIDTH{1'b1}} : ~({STRB_WIDTH{1'b1}} << rem8);
    strb_s <= (rem_s == 0) ? {STRB_WIDTH{1'b1}} : ~({STRB_WIDTH{1'b1}} << (4*rem_s));
end

// pointers: 0 PARAM_SRC 1 M_SRC 2 V_SRC 3 GRAD_SRC 4 PARAM_DST 5 M_DST 6 V_DST 7 COPY_DST
// 8 M_SCALE_SRC 9 V_SCALE_SRC 10 M_SCALE_DST 11 V_SCALE_DST
wire [11:0] ptr_used = {en_vs, en_ms, en_vs, en_ms, en_c, en_v, en_m, 1'b1, 1'b1, en_v, en_m, 1'b1};
reg [11:0] ptr_misaligned;
integer pi;
always @* begin
    for (pi = 0; pi < 12; pi = pi + 1) begin
        ptr_misaligned[pi] = ptr_used[pi] && (ptr_reg[64*pi +: BYTE_SHIFT] != 0);
    end
end

// run_start: one clock, the first of ST_RUN, decided in ST_SETUP (timing, docs/BENCHMARKS.md,
// The checks on n and the pointers end in these registers, not in the clock enables
// of every stream register of the reader and writer). It loads the engines and clears their
// FIFOs, the lanes' valid bits and l2l_optim_quant; nothing is issued in that clock. One
// register for each part it reaches (the reader, the writer and its push register,
// l2l_optim_quant, the side band), placed beside it (timing: one register's net across the
// part set the clock). Each is run_go a clock late; "& ~itself" (run_go is never high two
// clocks running) keeps synthesis from merging the copies into one.
wire run_go = (state_reg == ST_SETUP) && (ptr_misaligned == 0) && (n_reg != 0);
reg [3:0] run_start_reg;
wire start_rd = run_start_reg[0], start_wr = run_start_reg[1], start_q = run_start_reg[2],
     start_side = run_start_reg[3];
wire abort = status_reg[STATUS_AXI_ERROR_BIT];
// The engines are held (abort) from ap_start until run_start loads them: after an aborted
// run they keep that run's addresses and beats left, and with AXI_ERROR cleared at ap_start
// they would otherwise request stale bursts in ST_SETUP.
reg engines_held_reg;
wire engine_abort = abort || engines_held_reg;

wire [ADDR_WIDTH-1:0] ptr_a [0:11];
genvar k;
generate
for (k = 0; k < 12; k = k + 1) begin : g_ptr
    assign ptr_a[k] = ptr_reg[64*k +: ADDR_WIDTH];
end
endgenerate

// ---------------------------------------------------------------- read side
wire [5:0] rd_pop, rd_empty;
wire [6*DATA_WIDTH-1:0] rd_head;
localparam [8:0] TILE32 = TILE_BEATS, TILE16 = TILE_BEATS / 2, TILE8 = TILE_BEATS / 4;
wire rd_idle, rd_error;

l2l_optim_reader #(
    .DATA_WIDTH(DATA_WIDTH), .ADDR_WIDTH(ADDR_WIDTH), .ID_WIDTH(ID_WIDTH), .FIFO_DEPTH(FIFO_DEPTH)
) reader_inst (
    .clk(clk), .rst(rst),
    .start(start_rd), .abort(engine_abort),
    .stream_addr({ptr_a[9], ptr_a[8], ptr_a[3], ptr_a[2], ptr_a[1], ptr_a[0]}),
    .stream_beats({beats_s, beats_s, grad16 ? beats16 : beats32, q8 ? beats8 : beats32, q8 ? beats8 : beats32, beats32}),
    .stream_tile({9'd1, 9'd1, grad16 ? TILE16 : TILE32, q8 ? TILE8 : TILE32, q8 ? TILE8 : TILE32, TILE32}),
    .stream_enable({en_vs, en_ms, 1'b1, en_v, en_m, 1'b1}),
    .stream_ahead(6'b110000),
    .idle(rd_idle), .error(rd_error),
    .pop(rd_pop), .head(rd_head), .empty(rd_empty),
    .m_axi_arid(m_axi_arid), .m_axi_araddr(m_axi_araddr), .m_axi_arlen(m_axi_arlen),
    .m_axi_arsize(m_axi_arsize), .m_axi_arburst(m_axi_arburst), .m_axi_arlock(m_axi_arlock),
    .m_axi_arcache(m_axi_arcache), .m_axi_arprot(m_axi_arprot), .m_axi_arvalid(m_axi_arvalid),
    .m_axi_arready(m_axi_arready), .m_axi_rid(m_axi_rid), .m_axi_rlast(m_axi_rlast),
    .m_axi_rdata(m_axi_rdata), .m_axi_rresp(m_axi_rresp), .m_axi_rvalid(m_axi_rvalid),
    .m_axi_rready(m_axi_rready)
);

// ---------------------------------------------------------------- write side
wire [5:0] wr_push;
wire [6*DATA_WIDTH-1:0] wr_data;
wire [6*(FIFO_AW+1)-1:0] wr_count;
wire wr_idle, wr_error;

l2l_optim_writer #(
    .DATA_WIDTH(DATA_WIDTH), .ADDR_WIDTH(ADDR_WIDTH), .ID_WIDTH(ID_WIDTH), .FIFO_DEPTH(FIFO_DEPTH)
) writer_inst (
    .clk(clk), .rst(rst),
    .start(start_wr), .abort(engine_abort),
    .stream_addr({ptr_a[11], ptr_a[10], ptr_a[7], ptr_a[6], ptr_a[5], ptr_a[4]}),
    .stream_beats({beats_s, beats_s, beats16, q8 ? beats8 : beats32, q8 ? beats8 : beats32, beats32}),
    .stream_last_strb({strb_s, strb_s, strb16, q8 ? strb8 : strb32, q8 ? strb8 : strb32, strb32}),
    .stream_enable({en_vs, en_ms, en_c, en_v, en_m, 1'b1}),
    // half a tile (a quarter for the 8-bit codes): the issue credit keeps room in each FIFO
    // for what the groups in flight may still push (up to PIPE_LATENCY/RATIO + 2 beats, ~77 at
    // one group per clock and RATIO 2; codes: ~85 with the blocks l2l_optim_quant holds), so
    // a burst must fit in the rest, or the issue waits for the pipeline to drain
    .stream_burst({TILE16, TILE16, TILE16, q8 ? TILE8 : TILE16, q8 ? TILE8 : TILE16, TILE16}),
    .idle(wr_idle), .error(wr_error),
    .push(wr_push), .push_data(wr_data), .count(wr_count),
    .m_axi_awid(m_axi_awid), .m_axi_awaddr(m_axi_awaddr), .m_axi_awlen(m_axi_awlen),
    .m_axi_awsize(m_axi_awsize), .m_axi_awburst(m_axi_awburst), .m_axi_awlock(m_axi_awlock),
    .m_axi_awcache(m_axi_awcache), .m_axi_awprot(m_axi_awprot), .m_axi_awvalid(m_axi_awvalid),
    .m_axi_awready(m_axi_awready), .m_axi_wdata(m_axi_wdata), .m_axi_wstrb(m_axi_wstrb),
    .m_axi_wlast(m_axi_wlast), .m_axi_wvalid(m_axi_wvalid), .m_axi_wready(m_axi_wready),
    .m_axi_bid(m_axi_bid), .m_axi_bresp(m_axi_bresp), .m_axi_bvalid(m_axi_bvalid),
    .m_axi_bready(m_axi_bready)
);

// ---------------------------------------------------------------- issue
// Timing (docs/BENCHMARKS.md): every decision of the issue logic comes from
// registers: the groups left and the last-group flag are counted down, the credit is
// registered (two clocks early, see "Credit"), and the lanes take their operands from an
// input register after a register of the FIFO heads (ISSUE_STAGES), not from the FIFO read ports.
reg [31:0] left_reg;       // groups not yet issued
reg more_reg;              // left_reg != 0
reg last_reg;              // left_reg == 1: the group issued now is the last
reg [SUB_W-1:0] sub_reg;   // groups issued, modulo 4*RATIO
reg [BGW-1:0] bgi_reg;     // 8-bit state: the issued group's place in its block
reg [BSW-1:0] bsub_reg;    // 8-bit state: its block's scale in the scale beat
reg bgi_last_reg;          // bgi_reg == LAST_BLOCK_GROUP (timing: the pops decide from flip-flops)
reg bsub_last_reg;         // bsub_reg == LAST_BSUB
reg credit_reg;
reg [7:0] in_flight_reg;  // groups issued whose results have not left the lanes
reg [15:0] q_flight_reg;  // 8-bit state: groups issued whose codes have not left l2l_optim_quant
reg finish_reg;           // ST_RUN: the run has ended (idle engines, nothing in flight or left)

wire [FIFO_AW:0] wc_p = wr_count[0 +: FIFO_AW+1];
wire [FIFO_AW:0] wc_m = wr_count[(FIFO_AW+1) +: FIFO_AW+1];
wire [FIFO_AW:0] wc_v = wr_count[2*(FIFO_AW+1) +: FIFO_AW+1];
wire [FIFO_AW:0] wc_c = wr_count[3*(FIFO_AW+1) +: FIFO_AW+1];
wire [FIFO_AW:0] wc_ms = wr_count[4*(FIFO_AW+1) +: FIFO_AW+1];
wire [FIFO_AW:0] wc_vs = wr_count[5*(FIFO_AW+1) +: FIFO_AW+1];
// Credit (timing: two clocks of registers, one carry chain each). lim_*_reg is FIFO_DEPTH
// less the beats that the groups in flight may still push, from the in-flight counts of the
// clock before; credit_reg compares each write FIFO's count (a register) with it and is used
// the clock after. So it answers for the groups in flight two clocks before the issue that
// uses it plus the (up to) three issued since, f = x + 3 for the count register x. f groups
// push at most ceil(f/RATIO) + 1 beats of an fp32 stream (every RATIO-th group and the last),
// ceil(f/(2*RATIO)) + 1 of the copy, ceil(f/(4*RATIO)) + 1 of the 8-bit codes (f from the
// groups up to l2l_optim_quant's output), and one scale beat per block they touch plus both
// ends, and one more beat may wait in the push register (see "results"); each is bounded by a
// shift of x plus a constant (fp32: RATIO 1 x + 5, else (x >> log2 RATIO) + 4; copy
// (x >> log2 2*RATIO) + 4; codes (x >> log2 4*RATIO) + 4; scales (x >> log2 BLOCK_GROUPS) + 5),
// so each limit is one subtraction from a constant. A limit below zero (its MSB set) allows nothing.
localparam RATIO_SHIFT = $clog2(RATIO);
localparam integer LW = 18;
localparam integer LIM32_I = FIFO_DEPTH - ((RATIO == 1) ? 5 : 4);
localparam integer LIM_OTHER_I = FIFO_DEPTH - 4;
localparam integer LIM_S_I = FIFO_DEPTH - 5;
localparam [LW-1:0] LIM32 = LIM32_I[LW-1:0], LIM_OTHER = LIM_OTHER_I[LW-1:0], LIM_S = LIM_S_I[LW-1:0];
wire [LW-1:0] flight18 = {{(LW-8){1'b0}}, in_flight_reg};
wire [LW-1:0] q_flight18 = {{(LW-16){1'b0}}, q_flight_reg};
wire [LW-1:0] lim32 = LIM32 - (flight18 >> RATIO_SHIFT);
wire [LW-1:0] lim16 = LIM_OTHER - (flight18 >> (RATIO_SHIFT + 1));
wire [LW-1:0] lim8 = LIM_OTHER - (q_flight18 >> (RATIO_SHIFT + 2));
wire [LW-1:0] lim_s = LIM_S - (q_flight18 >> BGW);
reg [LW-1:0] lim_p_reg, lim_mv_reg, lim_c_reg, lim_s_reg;
function fits(input [FIFO_AW:0] count, input [LW-1:0] lim);
    fits = !lim[LW-1] && ({{(LW-FIFO_AW-1){1'b0}}, count} <= lim);
endfunction
wire credit = fits(wc_p, lim_p_reg)
           && (!en_m || fits(wc_m, lim_mv_reg)) && (!en_v || fits(wc_v, lim_mv_reg))
           && (!en_ms || fits(wc_ms, lim_s_reg)) && (!en_vs || fits(wc_vs, lim_s_reg))
           && (!en_c || fits(wc_c, lim_c_reg));
wire data_ready = !rd_empty[0] && (!en_m || !rd_empty[1]) && (!en_v || !rd_empty[2]) && !rd_empty[3]
                  && (!en_ms || !rd_empty[4]) && (!en_vs || !rd_empty[5]);
wire more = more_reg;
// run_ok_reg: ST_RUN and no abort in the clock before (timing: abort and the state reach the
// issue from one flip-flop). run_start's clock follows ST_SETUP, so it never issues; an abort
// stops the issue a clock late, which may move one more group (its data is in the FIFOs).
reg run_ok_reg;
wire issue = run_ok_reg && more && data_ready && credit_reg;
wire last_group = last_reg;
// read-side width conversion: group `sub` of the head beats; an 8-bit beat holds 4*RATIO
// groups, a 16-bit beat 2*RATIO, an fp32 beat RATIO (group sub % RATIO)
wire [SUB_W-1:0] sub = sub_reg;
wire sub_end8 = ((sub & SUB8) == SUB8);
wire sub_end16 = ((sub & SUB16) == SUB16);
wire sub_end32 = ((sub & SUB32) == SUB32);
wire state_end = q8 ? sub_end8 : sub_end32;
// 8-bit state: the last group of a block, the last block of a scale beat
wire block_end = bgi_last_reg || last_group;
localparam integer LAST_BSUB_I = BEAT_LANES - 1;
localparam [BSW-1:0] LAST_BSUB = LAST_BSUB_I[BSW-1:0];
wire scale_end = block_end && (bsub_last_reg || last_group);
wire [BGW-1:0] bgi_next = block_end ? {BGW{1'b0}} : bgi_reg + 1'b1;
wire [BSW-1:0] bsub_next = bsub_reg + 1'b1;

assign rd_pop = {issue && en_vs && scale_end, issue && en_ms && scale_end,
                 issue && ((grad16 ? sub_end16 : sub_end32) || last_group), issue && en_v && (state_end || last_group),
                 issue && en_m && (state_end || last_group), issue && (sub_end32 || last_group)};

// The FIFOs' head beats and the issued group's place in them, registered twice (timing:
// synthesis merges the first register into a block RAM's read port, whose clock-to-out,
// 4.3 ns on the ECP5, leaves no time for the group select; the second is in the fabric), then
// the groups of each head beat, indexed by sub (fp32 groups appear 4 times, 16-bit twice)
reg [6*DATA_WIDTH-1:0] head_ram_reg, head_reg;
reg [SUB_W-1:0] sub_d_reg, sub_q_reg;
reg [BSW-1:0] bsub_d_reg, bsub_q_reg;
always @(posedge clk) begin
    head_ram_reg <= rd_head;
    head_reg <= head_ram_reg;
    sub_d_reg <= sub;
    sub_q_reg <= sub_d_reg;
    bsub_d_reg <= bsub_reg;
    bsub_q_reg <= bsub_d_reg;
end
wire [GROUP_BITS-1:0] p_grp [0:4*RATIO-1];
wire [GROUP_BITS-1:0] m_grp [0:4*RATIO-1];
wire [GROUP_BITS-1:0] v_grp [0:4*RATIO-1];
wire [GROUP_BITS-1:0] g_grp [0:4*RATIO-1];
wire [GROUP_BITS/2-1:0] g16_grp [0:4*RATIO-1];
wire [GROUP_BITS/4-1:0] mc_grp [0:4*RATIO-1];
wire [GROUP_BITS/4-1:0] vc_grp [0:4*RATIO-1];
generate
for (k = 0; k < 4*RATIO; k = k + 1) begin : g_rd_group
    assign p_grp[k] = head_reg[GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign m_grp[k] = head_reg[DATA_WIDTH + GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign v_grp[k] = head_reg[2*DATA_WIDTH + GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign g_grp[k] = head_reg[3*DATA_WIDTH + GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign g16_grp[k] = head_reg[3*DATA_WIDTH + (GROUP_BITS/2)*(k % (2*RATIO)) +: GROUP_BITS/2];
    assign mc_grp[k] = head_reg[DATA_WIDTH + (GROUP_BITS/4)*k +: GROUP_BITS/4];
    assign vc_grp[k] = head_reg[2*DATA_WIDTH + (GROUP_BITS/4)*k +: GROUP_BITS/4];
end
endgenerate
wire [31:0] ms_head = head_reg[4*DATA_WIDTH + 32*bsub_q_reg +: 32];
wire [31:0] vs_head = head_reg[5*DATA_WIDTH + 32*bsub_q_reg +: 32];

// the lanes' input register: the operands of the group issued three clocks before
reg [GROUP_BITS-1:0] p_in, m_in, v_in, g_in;
reg [GROUP_BITS/4-1:0] mc_in, vc_in;
reg [31:0] ms_in, vs_in;
integer li;
always @(posedge clk) begin
    p_in <= p_grp[sub_q_reg];
    m_in <= en_m ? m_grp[sub_q_reg] : {GROUP_BITS{1'b0}};
    v_in <= en_v ? v_grp[sub_q_reg] : {GROUP_BITS{1'b0}};
    mc_in <= en_m ? mc_grp[sub_q_reg] : {(GROUP_BITS/4){1'b0}};
    vc_in <= en_v ? vc_grp[sub_q_reg] : {(GROUP_BITS/4){1'b0}};
    ms_in <= ms_head;
    vs_in <= vs_head;
    for (li = 0; li < LANES; li = li + 1) begin
        g_in[32*li +: 32] <= grad16 ? {16'd0, g16_grp[sub_q_reg][16*li +: 16]} : g_grp[sub_q_reg][32*li +: 32];
    end
end

// lanes beyond n in the last group carry whatever memory held: mask them
wire [LANES-1:0] lane_mask = (last_group && rem_lane != 0) ? ~({LANES{1'b1}} << rem_lane) : {LANES{1'b1}};

wire out_valid, out_last;
wire [SUB_W-1:0] out_sub;
wire [LANES-1:0] out_mask;
// q_valid: the group's results go to l2l_optim_quant's m and v slots (timing: its input valid
// and group count come from the delay line's flip-flops, not through the enables)
wire [1:0] q_valid;
l2l_optim_delay #(.WIDTH(LANES + SUB_W + 4), .DEPTH(PIPE_LATENCY), .RESET(1)) sideband (
    .clk(clk), .rst(rst || start_side),
    .x({issue, last_group, sub, lane_mask, issue && en_vs, issue && en_ms}),
    .y({out_valid, out_last, out_sub, out_mask, q_valid})
);

// ---------------------------------------------------------------- state decode
// m and v reach the lanes DEQUANT_LATENCY clocks after the input register, decoded from
// 8-bit codes or delayed fp32; p and g wait beside them
wire [GROUP_BITS-1:0] p_dq, g_dq, m_dq, v_dq, m32_d, v32_d, m8_d, v8_d;
l2l_optim_delay #(.WIDTH(4*GROUP_BITS), .DEPTH(DEQUANT_LATENCY)) dequant_wait (
    .clk(clk), .rst(rst), .x({p_in, g_in, m_in, v_in}), .y({p_dq, g_dq, m32_d, v32_d})
);
generate
for (k = 0; k < LANES; k = k + 1) begin : g_dequant
    l2l_optim_dequant #(.EXP_BITS(M_CODE_EXP_BITS), .SIGNED(1)) dequant_m (
        .clk(clk), .rst(rst), .code(mc_in[8*k +: 8]), .scale(ms_in), .y(m8_d[32*k +: 32]));
    l2l_optim_dequant #(.EXP_BITS(V_CODE_EXP_BITS), .SIGNED(0)) dequant_v (
        .clk(clk), .rst(rst), .code(vc_in[8*k +: 8]), .scale(vs_in), .y(v8_d[32*k +: 32]));
end
endgenerate
assign m_dq = q8 ? m8_d : m32_d;
assign v_dq = q8 ? v8_d : v32_d;

// ---------------------------------------------------------------- lanes
wire [GROUP_BITS-1:0] p_out, m_out, v_out;
wire [GROUP_BITS/2-1:0] c_out;
wire [LANES-1:0] nf_out;

generate
for (k = 0; k < LANES; k = k + 1) begin : g_lane
    l2l_optim_lane lane_inst (
        .clk(clk), .rst(rst),
        .mode_sgd(mode_sgd), .mode_adamw(mode_adamw), .nesterov(nesterov_reg),
        .wd_nonzero(wd_nonzero_reg), .mom_nonzero(mom_nonzero_reg),
        .grad_dtype(grad_dtype_reg), .copy_fp16(copy_dtype_reg == MODE_COPY_DTYPE_FP16),
        .inv_scale(arg_scalars[32*0 +: 32]),
        .lr(arg_scalars[32*1 +: 32]),
        .weight_decay(arg_scalars[32*2 +: 32]),
        .decay(arg_scalars[32*3 +: 32]),
        .one_minus_beta1(arg_scalars[32*5 +: 32]),
        .beta2(arg_scalars[32*6 +: 32]),
        .one_minus_beta2(arg_scalars[32*7 +: 32]),
        .step_size(arg_scalars[32*8 +: 32]),
        .bias_correction2_sqrt(arg_scalars[32*9 +: 32]),
        .eps(arg_scalars[32*10 +: 32]),
        .momentum(arg_scalars[32*11 +: 32]),
        .dampening_complement(arg_scalars[32*12 +: 32]),
        .p(p_dq[32*k +: 32]),
        .m(m_dq[32*k +: 32]),
        .v(v_dq[32*k +: 32]),
        .g(g_dq[32*k +: 32]),
        .p_out(p_out[32*k +: 32]), .m_out(m_out[32*k +: 32]), .v_out(v_out[32*k +: 32]),
        .copy_out(c_out[16*k +: 16]), .nonfinite(nf_out[k])
    );
end
endgenerate

/* verilator lint_off UNUSEDSIGNAL */
wire [31:0] unused_beta1 = arg_scalars[32*4 +: 32];
wire [31:0] unused_mode = arg_mode;
/* verilator lint_on UNUSEDSIGNAL */

// ---------------------------------------------------------------- results
// write-side width conversion: group out_sub of a beat is the lanes' output,
// the groups before it come from the assembly registers; a beat is pushed at
// its last group or at the last group of the run (the write strobe of the
// last beat masks the stale groups after it)
wire out_end16 = ((out_sub & SUB16) == SUB16);
wire out_end32 = ((out_sub & SUB32) == SUB32);
wire [DATA_WIDTH-1:0] p_beat, m_beat, v_beat, c_beat;
reg [DATA_WIDTH-1:0] p_acc_reg, m_acc_reg, v_acc_reg, c_acc_reg;

generate
for (k = 0; k < RATIO; k = k + 1) begin : g_wr_group32
    localparam [SUB_W-1:0] SLOT = k;
    wire here = ((out_sub & SUB32) == SLOT);
    assign p_beat[GROUP_BITS*k +: GROUP_BITS] = here ? p_out : p_acc_reg[GROUP_BITS*k +: GROUP_BITS];
    assign m_beat[GROUP_BITS*k +: GROUP_BITS] = here ? m_out : m_acc_reg[GROUP_BITS*k +: GROUP_BITS];
    assign v_beat[GROUP_BITS*k +: GROUP_BITS] = here ? v_out : v_acc_reg[GROUP_BITS*k +: GROUP_BITS];
end
for (k = 0; k < 2*RATIO; k = k + 1) begin : g_wr_group16
    localparam [SUB_W-1:0] SLOT = k;
    assign c_beat[(GROUP_BITS/2)*k +: GROUP_BITS/2] = ((out_sub & SUB16) == SLOT) ? c_out : c_acc_reg[(GROUP_BITS/2)*k +: GROUP_BITS/2];
end
endgenerate

// 8-bit state: per slot (0 m, 1 v) the encoder, then its codes and scales into beats
// flat vectors, not arrays: an array element on a port of a not yet elaborated module makes
// yosys reprocess this module, which its hierarchy pass (0.70) fails on
wire [2*GROUP_BITS-1:0] q_x = {v_out, m_out};
wire [1:0] q_out_valid, q_out_last, q_scale_valid, q_scale_last;
wire [2*(GROUP_BITS/4)-1:0] q_code;
wire [2*32-1:0] q_scale;
wire [2*16-1:0] q_held;
wire [DATA_WIDTH-1:0] qc_beat [0:1];
wire [DATA_WIDTH-1:0] qs_beat [0:1];
wire [1:0] qc_push, qs_push;
generate
for (k = 0; k < 2; k = k + 1) begin : g_quant
    l2l_optim_quant #(.LANES(LANES), .EXP_BITS(k == 0 ? M_CODE_EXP_BITS : V_CODE_EXP_BITS), .SIGNED(k == 0 ? 1 : 0)) quant (
        .clk(clk), .rst(rst), .clear(start_q),
        .in_valid(q_valid[k]), .in_last(out_last), .in_mask(out_mask), .in_x(q_x[GROUP_BITS*k +: GROUP_BITS]),
        .scale_valid(q_scale_valid[k]), .scale_last(q_scale_last[k]), .scale(q_scale[32*k +: 32]),
        .out_valid(q_out_valid[k]), .out_last(q_out_last[k]), .out_code(q_code[(GROUP_BITS/4)*k +: GROUP_BITS/4]),
        .held(q_held[16*k +: 16])
    );
    // codes: 4*RATIO groups a beat
    reg [SUB_W-1:0] csub_reg;
    reg [DATA_WIDTH-1:0] cacc_reg;
    genvar j;
    for (j = 0; j < 4*RATIO; j = j + 1) begin : g_code_group
        localparam [SUB_W-1:0] SLOT = j;
        assign qc_beat[k][(GROUP_BITS/4)*j +: GROUP_BITS/4] = (csub_reg == SLOT) ? q_code[(GROUP_BITS/4)*k +: GROUP_BITS/4]
                                                            : cacc_reg[(GROUP_BITS/4)*j +: GROUP_BITS/4];
    end
    assign qc_push[k] = q_out_valid[k] && ((csub_reg == SUB8) || q_out_last[k]);
    // scales: BEAT_LANES a beat
    reg [BSW-1:0] ssub_reg;
    reg [DATA_WIDTH-1:0] sacc_reg;
    for (j = 0; j < BEAT_LANES; j = j + 1) begin : g_scale_slot
        localparam [BSW-1:0] SLOT = j;
        assign qs_beat[k][32*j +: 32] = (ssub_reg == SLOT) ? q_scale[32*k +: 32] : sacc_reg[32*j +: 32];
    end
    assign qs_push[k] = q_scale_valid[k] && ((ssub_reg == LAST_BSUB) || q_scale_last[k]);
    always @(posedge clk) begin
        if (q_out_valid[k]) begin
            csub_reg <= csub_reg + 1'b1;
            cacc_reg <= qc_beat[k];
        end
        if (q_scale_valid[k]) begin
            ssub_reg <= ssub_reg + 1'b1;
            sacc_reg <= qs_beat[k];
        end
        if (rst || start_q) begin
            csub_reg <= {SUB_W{1'b0}};
            ssub_reg <= {BSW{1'b0}};
        end
    end
end
endgenerate

// The beats pushed into the writer's FIFOs, registered (timing: the push decisions of the
// width conversion and l2l_optim_quant would otherwise run on into the FIFOs' counters across
// the part); the credit keeps room for the beat waiting here. A push decided in run_start's
// clock is an aborted run's and is dropped, as the FIFOs are cleared.
wire out_push32 = out_valid && (out_end32 || out_last);
reg [5:0] wr_push_reg;
reg [6*DATA_WIDTH-1:0] wr_data_reg;
always @(posedge clk) begin
    wr_push_reg <= (rst || start_wr) ? 6'd0
                 : {qs_push[1], qs_push[0], en_c && out_valid && (out_end16 || out_last),
                    q8 ? qc_push[1] : out_push32 && en_v, q8 ? qc_push[0] : out_push32 && en_m, out_push32};
    wr_data_reg <= {qs_beat[1], qs_beat[0], c_beat, q8 ? qc_beat[1] : v_beat, q8 ? qc_beat[0] : m_beat, p_beat};
end
assign wr_push = wr_push_reg;
assign wr_data = wr_data_reg;
wire q_out = en_m ? q_out_valid[0] : q_out_valid[1];
wire q_idle = q_held == 32'd0;

// ---------------------------------------------------------------- sequencing
always @(posedge clk) begin
    ap_done_reg <= 1'b0;
    run_start_reg <= {4{run_go}} & ~run_start_reg;

    credit_reg <= credit;
    lim_p_reg <= lim32;
    lim_mv_reg <= q8 ? lim8 : lim32;
    lim_c_reg <= lim16;
    lim_s_reg <= lim_s;
    run_ok_reg <= (state_reg == ST_RUN) && !abort;
    // the end of a run, a clock late (timing): once true it stays true, nothing more is issued
    finish_reg <= rd_idle && wr_idle && in_flight_reg == 0 && q_idle && !issue && (!more || abort);
    if (issue) begin
        left_reg <= left_reg - 32'd1;
        more_reg <= !last_reg;
        last_reg <= (left_reg == 32'd2);
        sub_reg <= sub_reg + 1'b1;
        bgi_reg <= bgi_next;
        bgi_last_reg <= (bgi_next == LAST_BLOCK_GROUP);
        if (block_end) begin
            bsub_reg <= bsub_next;
            bsub_last_reg <= (bsub_next == LAST_BSUB);
        end
    end
    // +1, -1 (all ones) or 0: one carry chain each
    in_flight_reg <= in_flight_reg + {{7{out_valid && !issue}}, out_valid != issue};
    q_flight_reg <= q_flight_reg + {{15{q8 && q_out && !issue}}, q8 && (q_out != issue)};
    if (out_valid) begin
        p_acc_reg <= p_beat;
        m_acc_reg <= m_beat;
        v_acc_reg <= v_beat;
        c_acc_reg <= c_beat;
    end
    if (out_valid && ((nf_out & out_mask) != 0)) begin
        status_reg[STATUS_NONFINITE_BIT] <= 1'b1;
    end
    if ((rd_error || wr_error) && state_reg == ST_RUN) begin
        status_reg[STATUS_AXI_ERROR_BIT] <= 1'b1;
    end
    if (state_reg != ST_IDLE) begin
        cycles_reg <= cycles_reg + 64'd1;
    end

    case (state_reg)
        ST_IDLE: begin
            if (ap_start && !ap_done_reg) begin  // ap_start clears at ap_ready, one clock late
                ptr_reg <= {arg_scale_pointers, arg_pointers};
                state8_reg <= arg_8bit;
                en_m <= arg_en_m;
                en_v <= !arg_sgd;
                en_c <= (arg_mode[MODE_COPY_DTYPE_BIT +: 2] != MODE_COPY_DTYPE_NONE);
                grad16 <= (arg_mode[MODE_GRAD_DTYPE_BIT +: 2] != MODE_GRAD_DTYPE_FP32);
                en_ms <= arg_en_m && arg_8bit;
                en_vs <= !arg_sgd && arg_8bit;
                n_reg <= arg_n;
                opt_reg <= arg_mode[MODE_OPTIMIZER_BIT +: 2];
                nesterov_reg <= arg_mode[MODE_NESTEROV_BIT];
                grad_dtype_reg <= arg_mode[MODE_GRAD_DTYPE_BIT +: 2];
                copy_dtype_reg <= arg_mode[MODE_COPY_DTYPE_BIT +: 2];
                wd_nonzero_reg <= (s_weight_decay != 0);
                mom_nonzero_reg <= (s_momentum != 0);
                status_reg <= 3'd0;
                cycles_reg <= 64'd1;
                engines_held_reg <= 1'b1;
                state_reg <= ST_SETUP;
            end
        end
        ST_SETUP: begin
            left_reg <= groups;
            more_reg <= (groups != 32'd0);
            last_reg <= (groups == 32'd1);
            sub_reg <= {SUB_W{1'b0}};
            bgi_reg <= {BGW{1'b0}};
            bsub_reg <= {BSW{1'b0}};
            bgi_last_reg <= (LAST_BLOCK_GROUP == {BGW{1'b0}});
            bsub_last_reg <= (LAST_BSUB == {BSW{1'b0}});
            in_flight_reg <= 8'd0;
            q_flight_reg <= 16'd0;
            finish_reg <= 1'b0;
            if (ptr_misaligned != 0) begin
                status_reg[STATUS_MISALIGNED_BIT] <= 1'b1;
                state_reg <= ST_FINISH;
            end else if (n_reg == 0) begin
                state_reg <= ST_FINISH;
            end else begin
                engines_held_reg <= 1'b0;
                state_reg <= ST_RUN;
            end
        end
        ST_RUN: begin
            if (finish_reg) begin
                state_reg <= ST_FINISH;
            end
        end
        default: begin  // ST_FINISH
            ap_done_reg <= 1'b1;
            state_reg <= ST_IDLE;
        end
    endcase

    if (rst) begin
        state_reg <= ST_IDLE;
        ap_done_reg <= 1'b0;
        run_start_reg <= 4'd0;
        engines_held_reg <= 1'b1;
        status_reg <= 3'd0;
        left_reg <= 32'd0;
        more_reg <= 1'b0;
        last_reg <= 1'b0;
        sub_reg <= {SUB_W{1'b0}};
        credit_reg <= 1'b0;
        in_flight_reg <= 8'd0;
        q_flight_reg <= 16'd0;
        run_ok_reg <= 1'b0;
        finish_reg <= 1'b0;
        cycles_reg <= 64'd0;
    end
end

endmodule

`resetall
