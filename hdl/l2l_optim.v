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
localparam ISSUE_STAGES = 1;  // the lanes' input register (see "issue")
localparam BEAT_LANES = DATA_WIDTH/32;          // fp32 elements per beat
localparam RATIO = BEAT_LANES/LANES;            // groups per fp32 beat
localparam SUB_W = $clog2(RATIO) + 1;           // group index in a 16-bit beat
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
    if (ISSUE_STAGES + LANE_LATENCY > 254) begin
        $error("Error: LANE_LATENCY %0d does not fit the 8-bit in-flight count (instance %m)", LANE_LATENCY);
        $finish;
    end
    if (TILE_BEATS < 2 || TILE_BEATS > 256 || FIFO_DEPTH < 2*TILE_BEATS) begin
        $error("Error: need 2 <= TILE_BEATS <= 256 and FIFO_DEPTH >= 2*TILE_BEATS (instance %m)");
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
    .pointers(arg_pointers), .n(arg_n), .mode(arg_mode), .scalars(arg_scalars),
    .status({29'd0, status_reg}), .cycles(cycles_reg)
);

// arguments latched at ap_start
reg [64*8-1:0] ptr_reg;
reg [31:0] n_reg;
reg [1:0] opt_reg;
reg nesterov_reg;
reg [1:0] grad_dtype_reg, copy_dtype_reg;
reg mom_nonzero_reg, wd_nonzero_reg;

wire [30:0] s_weight_decay = arg_scalars[32*2 +: 31];
wire [30:0] s_momentum = arg_scalars[32*11 +: 31];

wire mode_sgd = (opt_reg == MODE_OPTIMIZER_SGD);
wire mode_adamw = (opt_reg == MODE_OPTIMIZER_ADAMW);
wire en_m = !mode_sgd || mom_nonzero_reg;
wire en_v = !mode_sgd;
wire en_c = (copy_dtype_reg != MODE_COPY_DTYPE_NONE);
wire grad16 = (grad_dtype_reg != MODE_GRAD_DTYPE_FP32);

// groups of LANES elements; beats: BEAT_LANES fp32 elements, 2*BEAT_LANES 16-bit ones
/* verilator lint_off UNUSEDSIGNAL */
wire [32:0] groups_w = ({1'b0, n_reg} + (LANES - 1)) >> LANE_SHIFT;
wire [31:0] groups = groups_w[31:0];
wire [32:0] beats32_w = ({1'b0, n_reg} + (BEAT_LANES - 1)) >> BEAT_SHIFT;
wire [31:0] beats32 = beats32_w[31:0];
wire [32:0] beats16_w = ({1'b0, n_reg} + (2*BEAT_LANES - 1)) >> (BEAT_SHIFT + 1);
wire [31:0] beats16 = beats16_w[31:0];
/* verilator lint_on UNUSEDSIGNAL */
wire [BEAT_SHIFT:0] rem32 = {1'b0, n_reg[BEAT_SHIFT-1:0]};
wire [BEAT_SHIFT+1:0] rem16 = {1'b0, n_reg[BEAT_SHIFT:0]};
wire [31:0] rem_lane = n_reg & (LANES - 1);
wire [STRB_WIDTH-1:0] strb32 = (rem32 == 0) ? {STRB_WIDTH{1'b1}} : ~({STRB_WIDTH{1'b1}} << (4*rem32));
wire [STRB_WIDTH-1:0] strb16 = (rem16 == 0) ? {STRB_WIDTH{1'b1}} : ~({STRB_WIDTH{1'b1}} << (2*rem16));

// pointers: 0 PARAM_SRC 1 M_SRC 2 V_SRC 3 GRAD_SRC 4 PARAM_DST 5 M_DST 6 V_DST 7 COPY_DST
wire [7:0] ptr_used = {en_c, en_v, en_m, 1'b1, 1'b1, en_v, en_m, 1'b1};
reg [7:0] ptr_misaligned;
integer pi;
always @* begin
    for (pi = 0; pi < 8; pi = pi + 1) begin
        ptr_misaligned[pi] = ptr_used[pi] && (ptr_reg[64*pi +: BYTE_SHIFT] != 0);
    end
end

wire run_start = (state_reg == ST_SETUP) && (ptr_misaligned == 0) && (n_reg != 0);
wire abort = status_reg[STATUS_AXI_ERROR_BIT];

wire [ADDR_WIDTH-1:0] ptr_a [0:7];
genvar k;
generate
for (k = 0; k < 8; k = k + 1) begin : g_ptr
    assign ptr_a[k] = ptr_reg[64*k +: ADDR_WIDTH];
end
endgenerate

// ---------------------------------------------------------------- read side
wire [3:0] rd_pop, rd_empty;
wire [4*DATA_WIDTH-1:0] rd_head;
wire rd_idle, rd_error;

l2l_optim_reader #(
    .DATA_WIDTH(DATA_WIDTH), .ADDR_WIDTH(ADDR_WIDTH), .ID_WIDTH(ID_WIDTH), .FIFO_DEPTH(FIFO_DEPTH)
) reader_inst (
    .clk(clk), .rst(rst),
    .start(run_start), .abort(abort),
    .stream_addr({ptr_a[3], ptr_a[2], ptr_a[1], ptr_a[0]}),
    .stream_beats({grad16 ? beats16 : beats32, beats32, beats32, beats32}),
    .stream_tile({grad16 ? TILE_BEATS[9:1] : TILE_BEATS[8:0], TILE_BEATS[8:0], TILE_BEATS[8:0], TILE_BEATS[8:0]}),
    .stream_enable({1'b1, en_v, en_m, 1'b1}),
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
wire [3:0] wr_push;
wire [4*DATA_WIDTH-1:0] wr_data;
wire [4*(FIFO_AW+1)-1:0] wr_count;
wire wr_idle, wr_error;

l2l_optim_writer #(
    .DATA_WIDTH(DATA_WIDTH), .ADDR_WIDTH(ADDR_WIDTH), .ID_WIDTH(ID_WIDTH), .FIFO_DEPTH(FIFO_DEPTH),
    .BURST_BEATS(TILE_BEATS)
) writer_inst (
    .clk(clk), .rst(rst),
    .start(run_start), .abort(abort),
    .stream_addr({ptr_a[7], ptr_a[6], ptr_a[5], ptr_a[4]}),
    .stream_beats({beats16, beats32, beats32, beats32}),
    .stream_last_strb({strb16, strb32, strb32, strb32}),
    .stream_enable({en_c, en_v, en_m, 1'b1}),
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
// Timing (docs/BENCHMARKS.md, issue 19): every decision of the issue logic comes from
// registers: the groups left and the last-group flag are counted down, the credit is
// registered one clock early (so it reserves room for one more group), and the lanes take
// their operands from an input register (ISSUE_STAGES), not from the FIFO read ports.
reg [31:0] left_reg;       // groups not yet issued
reg more_reg;              // left_reg != 0
reg last_reg;              // left_reg == 1: the group issued now is the last
reg [SUB_W-1:0] sub_reg;   // groups issued, modulo 2*RATIO
reg credit_reg;
reg [7:0] in_flight_reg;  // groups issued whose results have not left the lanes

wire [FIFO_AW:0] wc_p = wr_count[0 +: FIFO_AW+1];
wire [FIFO_AW:0] wc_m = wr_count[(FIFO_AW+1) +: FIFO_AW+1];
wire [FIFO_AW:0] wc_v = wr_count[2*(FIFO_AW+1) +: FIFO_AW+1];
wire [FIFO_AW:0] wc_c = wr_count[3*(FIFO_AW+1) +: FIFO_AW+1];
// credit_reg is computed one clock before it is used, when one more group may still be
// issued: count that one as in flight.
wire [FIFO_AW+1:0] flight = {{(FIFO_AW+2-8){1'b0}}, in_flight_reg} + 1'b1;

// Beats that the groups in flight and the one being issued may still push: an fp32
// stream pushes at every RATIO-th group and at the last one, so at most
// ceil((flight+1)/RATIO) + 1 (flight + 1 at RATIO = 1, every group a beat); the copy
// ceil((flight+1)/(2*RATIO)) + 1.
localparam [31:0] RATIO_32 = RATIO;
localparam [FIFO_AW+1:0] RATIO_W = RATIO_32[FIFO_AW+1:0];
localparam RATIO_SHIFT = $clog2(RATIO);
wire [FIFO_AW+1:0] due32 = (RATIO == 1) ? flight + 1 : ((flight + RATIO_W) >> RATIO_SHIFT) + 1;
wire [FIFO_AW+1:0] due16 = ((flight + 2*RATIO_W) >> (RATIO_SHIFT + 1)) + 1;
wire credit = ({1'b0, wc_p} + due32 <= FIFO_DEPTH)
           && (!en_m || {1'b0, wc_m} + due32 <= FIFO_DEPTH)
           && (!en_v || {1'b0, wc_v} + due32 <= FIFO_DEPTH)
           && (!en_c || ((RATIO == 1) ? {wc_c, 1'b0} + flight + 2 <= 2*FIFO_DEPTH
                                      : {1'b0, wc_c} + due16 <= FIFO_DEPTH));
wire data_ready = !rd_empty[0] && (!en_m || !rd_empty[1]) && (!en_v || !rd_empty[2]) && !rd_empty[3];
wire more = more_reg;
wire issue = (state_reg == ST_RUN) && !abort && more && data_ready && credit_reg;
wire last_group = last_reg;
// read-side width conversion: group `sub` of the head beats; a 16-bit beat
// holds 2*RATIO groups, an fp32 beat RATIO (group sub % RATIO)
wire [SUB_W-1:0] sub = sub_reg;
wire sub_end16 = (sub == {SUB_W{1'b1}});
wire sub_end32 = (sub == {SUB_W{1'b1}}) || (sub == {1'b0, {(SUB_W-1){1'b1}}});

assign rd_pop = {issue && ((grad16 ? sub_end16 : sub_end32) || last_group), issue && en_v && (sub_end32 || last_group),
                 issue && en_m && (sub_end32 || last_group), issue && (sub_end32 || last_group)};

// the groups of each head beat, indexed by sub (fp32 groups appear twice)
wire [GROUP_BITS-1:0] p_grp [0:2*RATIO-1];
wire [GROUP_BITS-1:0] m_grp [0:2*RATIO-1];
wire [GROUP_BITS-1:0] v_grp [0:2*RATIO-1];
wire [GROUP_BITS-1:0] g_grp [0:2*RATIO-1];
wire [GROUP_BITS/2-1:0] g16_grp [0:2*RATIO-1];
generate
for (k = 0; k < 2*RATIO; k = k + 1) begin : g_rd_group
    assign p_grp[k] = rd_head[GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign m_grp[k] = rd_head[DATA_WIDTH + GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign v_grp[k] = rd_head[2*DATA_WIDTH + GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign g_grp[k] = rd_head[3*DATA_WIDTH + GROUP_BITS*(k % RATIO) +: GROUP_BITS];
    assign g16_grp[k] = rd_head[3*DATA_WIDTH + (GROUP_BITS/2)*k +: GROUP_BITS/2];
end
endgenerate
// the lanes' input register: the operands of the group issued in the clock before
reg [GROUP_BITS-1:0] p_in, m_in, v_in, g_in;
integer li;
always @(posedge clk) begin
    p_in <= p_grp[sub];
    m_in <= en_m ? m_grp[sub] : {GROUP_BITS{1'b0}};
    v_in <= en_v ? v_grp[sub] : {GROUP_BITS{1'b0}};
    for (li = 0; li < LANES; li = li + 1) begin
        g_in[32*li +: 32] <= grad16 ? {16'd0, g16_grp[sub][16*li +: 16]} : g_grp[sub][32*li +: 32];
    end
end

// lanes beyond n in the last group carry whatever memory held: mask them
wire [LANES-1:0] lane_mask = (last_group && rem_lane != 0) ? ~({LANES{1'b1}} << rem_lane) : {LANES{1'b1}};

wire out_valid, out_last;
wire [SUB_W-1:0] out_sub;
wire [LANES-1:0] out_mask;
l2l_optim_delay #(.WIDTH(LANES + SUB_W + 2), .DEPTH(ISSUE_STAGES + LANE_LATENCY), .RESET(1)) sideband (
    .clk(clk), .rst(rst || run_start),
    .x({issue, last_group, sub, lane_mask}),
    .y({out_valid, out_last, out_sub, out_mask})
);

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
        .p(p_in[32*k +: 32]),
        .m(m_in[32*k +: 32]),
        .v(v_in[32*k +: 32]),
        .g(g_in[32*k +: 32]),
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
wire out_end16 = (out_sub == {SUB_W{1'b1}});
wire out_end32 = (out_sub == {SUB_W{1'b1}}) || (out_sub == {1'b0, {(SUB_W-1){1'b1}}});
wire [DATA_WIDTH-1:0] p_beat, m_beat, v_beat, c_beat;
reg [DATA_WIDTH-1:0] p_acc_reg, m_acc_reg, v_acc_reg, c_acc_reg;

generate
for (k = 0; k < RATIO; k = k + 1) begin : g_wr_group32
    localparam [SUB_W-1:0] SLOT_LO = k;
    localparam integer HI = k + RATIO;  // the same group in the second half of a 16-bit count
    localparam [SUB_W-1:0] SLOT_HI = HI[SUB_W-1:0];
    wire here = (out_sub == SLOT_LO) || (out_sub == SLOT_HI);
    assign p_beat[GROUP_BITS*k +: GROUP_BITS] = here ? p_out : p_acc_reg[GROUP_BITS*k +: GROUP_BITS];
    assign m_beat[GROUP_BITS*k +: GROUP_BITS] = here ? m_out : m_acc_reg[GROUP_BITS*k +: GROUP_BITS];
    assign v_beat[GROUP_BITS*k +: GROUP_BITS] = here ? v_out : v_acc_reg[GROUP_BITS*k +: GROUP_BITS];
end
for (k = 0; k < 2*RATIO; k = k + 1) begin : g_wr_group16
    localparam [SUB_W-1:0] SLOT = k;
    assign c_beat[(GROUP_BITS/2)*k +: GROUP_BITS/2] = (out_sub == SLOT) ? c_out : c_acc_reg[(GROUP_BITS/2)*k +: GROUP_BITS/2];
end
endgenerate

wire out_push32 = out_valid && (out_end32 || out_last);
assign wr_push = {en_c && out_valid && (out_end16 || out_last), out_push32 && en_v, out_push32 && en_m, out_push32};
assign wr_data = {c_beat, v_beat, m_beat, p_beat};

// ---------------------------------------------------------------- sequencing
always @(posedge clk) begin
    ap_done_reg <= 1'b0;

    credit_reg <= credit;
    if (issue) begin
        left_reg <= left_reg - 32'd1;
        more_reg <= !last_reg;
        last_reg <= (left_reg == 32'd2);
        sub_reg <= sub_reg + 1'b1;
    end
    in_flight_reg <= in_flight_reg + {7'd0, issue} - {7'd0, out_valid};
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
                ptr_reg <= arg_pointers;
                n_reg <= arg_n;
                opt_reg <= arg_mode[MODE_OPTIMIZER_BIT +: 2];
                nesterov_reg <= arg_mode[MODE_NESTEROV_BIT];
                grad_dtype_reg <= arg_mode[MODE_GRAD_DTYPE_BIT +: 2];
                copy_dtype_reg <= arg_mode[MODE_COPY_DTYPE_BIT +: 2];
                wd_nonzero_reg <= (s_weight_decay != 0);
                mom_nonzero_reg <= (s_momentum != 0);
                status_reg <= 3'd0;
                cycles_reg <= 64'd1;
                state_reg <= ST_SETUP;
            end
        end
        ST_SETUP: begin
            left_reg <= groups;
            more_reg <= (groups != 32'd0);
            last_reg <= (groups == 32'd1);
            sub_reg <= {SUB_W{1'b0}};
            in_flight_reg <= 8'd0;
            if (ptr_misaligned != 0) begin
                status_reg[STATUS_MISALIGNED_BIT] <= 1'b1;
                state_reg <= ST_FINISH;
            end else if (n_reg == 0) begin
                state_reg <= ST_FINISH;
            end else begin
                state_reg <= ST_RUN;
            end
        end
        ST_RUN: begin
            if (rd_idle && wr_idle && in_flight_reg == 0 && !issue && (!more || abort)) begin
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
        status_reg <= 3'd0;
        left_reg <= 32'd0;
        more_reg <= 1'b0;
        last_reg <= 1'b0;
        sub_reg <= {SUB_W{1'b0}};
        credit_reg <= 1'b0;
        in_flight_reg <= 8'd0;
        cycles_reg <= 64'd0;
    end
end

endmodule

`resetall
