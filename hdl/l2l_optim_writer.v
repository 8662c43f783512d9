// SPDX-License-Identifier: Apache-2.0
// Write side of l2l_optim: one FIFO per result stream and an AXI4 AW/W/B
// burst engine.
//
// Streams 0..5 = param, m, v, working copy, m scales, v scales (the last two
// with the 8-bit state). The datapath pushes result beats;
// the engine visits the enabled streams round robin and requests a burst of
// min(stream_burst[s], beats left, beats to the next 4 KiB boundary) as soon as
// the stream FIFO holds that many beats not yet promised to an earlier burst.
// The W beats follow the AW order (a queue of {stream, length}); W data is
// always already in the FIFO, so an issued burst always completes. The last
// beat of a stream carries last_strb (bytes beyond element n are never
// written). Every B response is awaited; bresp SLVERR/DECERR raises error.
//
// abort stops new bursts (a clock late: it is registered here, as its fan-out is wide); the
// W beats and B responses of issued bursts are still completed, then the engine reports idle.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_writer #
(
    parameter DATA_WIDTH = 64,
    parameter ADDR_WIDTH = 64,
    parameter ID_WIDTH = 1,
    parameter FIFO_DEPTH = 128,
    parameter QUEUE_DEPTH = 8,
    parameter STREAMS = 6,
    parameter STRB_WIDTH = (DATA_WIDTH/8),
    parameter FIFO_AW = $clog2(FIFO_DEPTH)
)
(
    input  wire                        clk,
    input  wire                        rst,

    input  wire                        start,
    input  wire                        abort,
    input  wire [STREAMS*ADDR_WIDTH-1:0] stream_addr,
    input  wire [STREAMS*32-1:0]       stream_beats,
    input  wire [STREAMS*STRB_WIDTH-1:0] stream_last_strb,
    input  wire [STREAMS-1:0]          stream_enable,
    // longest burst per stream (1..256): a stream whose FIFO may not fill (the 8-bit codes,
    // whose issue credit reserves room for the blocks l2l_optim_quant holds) bursts shorter
    input  wire [STREAMS*9-1:0]        stream_burst,
    output wire                        idle,
    output wire                        error,

    input  wire [STREAMS-1:0]          push,
    input  wire [STREAMS*DATA_WIDTH-1:0] push_data,
    output wire [STREAMS*(FIFO_AW+1)-1:0] count,

    /*
     * AXI4 master, write channels
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
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [ID_WIDTH-1:0]         m_axi_bid,
    input  wire [1:0]                  m_axi_bresp,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire                        m_axi_bvalid,
    output wire                        m_axi_bready
);

localparam BYTE_SHIFT = $clog2(STRB_WIDTH);
localparam QUEUE_AW = $clog2(QUEUE_DEPTH);
localparam SW = $clog2(STREAMS);
localparam [SW-1:0] LAST_STREAM = STREAMS - 1;

reg [ADDR_WIDTH-1:0] addr_reg [0:STREAMS-1];
reg [31:0] left_reg [0:STREAMS-1];        // beats not yet requested on AW
reg [31:0] wleft_reg [0:STREAMS-1];       // beats not yet sent on W
// Beats pushed into each FIFO and beats claimed by its issued bursts, both since start (mod
// 2^16): their difference is what the FIFO holds that no burst claims yet (timing: one carry
// chain each, where count minus promised-and-not-yet-sent took two and a pop)
reg [15:0] pushed_reg [0:STREAMS-1];
reg [15:0] claimed_reg [0:STREAMS-1];
reg [SW-1:0] s_reg;

reg awvalid_reg;
reg [ADDR_WIDTH-1:0] awaddr_reg;
reg [7:0] awlen_reg;
reg [15:0] b_pending_reg;
reg abort_reg;       // abort, a clock late
reg queue_room_reg;  // the AW queue has room for one more burst
reg b_room_reg;      // b_pending_reg may count one more burst

assign m_axi_awid = {ID_WIDTH{1'b0}};
assign m_axi_awaddr = awaddr_reg;
assign m_axi_awlen = awlen_reg;
assign m_axi_awsize = BYTE_SHIFT[2:0];
assign m_axi_awburst = 2'b01;
assign m_axi_awlock = 1'b0;
assign m_axi_awcache = 4'b0011;
assign m_axi_awprot = 3'b010;
assign m_axi_awvalid = awvalid_reg;
assign m_axi_bready = 1'b1;

// ---------------------------------------------------------------- AW
// The visit: go_reg says whether stream s_reg's burst was planned and settled, a clock
// late (timing: the issue is an AND of registers); sel_reg is that stream. Its state
// changes only at its own issue, and an issue is never followed by one in the next clock
// (awvalid_reg), when s_reg has moved on, so a clock-old go_reg is still exact.
reg go_reg;
reg [SW-1:0] sel_reg;
reg [STREAMS-1:0] sel_onehot_reg;
wire [ADDR_WIDTH-1:0] cur_addr = addr_reg[sel_reg];
// Each stream's next burst is planned in registers, three clocks deep (timing: one carry
// chain per clock): the beats to its 4 KiB page end and its beats left capped at
// stream_burst, then the burst's length (the smaller), then whether its FIFO holds all of
// it. A plan is used only once the stream's state has been stable for three clocks
// (settle_reg); in between, the FIFO only fills, so a stale "ready" is conservative.
reg [12:0] page_reg [0:STREAMS-1];  // beats to the 4 KiB page end
reg [8:0] first_reg [0:STREAMS-1];   // beats left, at most stream_burst
reg [8:0] len_reg [0:STREAMS-1];
reg [STREAMS-1:0] ready_reg;
reg [2:0] settle_reg [0:STREAMS-1];
reg [STREAMS-1:0] wlast_reg;         // wleft_reg == 1: the stream's next W beat is its last
wire [8:0] burst_len = len_reg[sel_reg];
/* verilator lint_off UNUSEDSIGNAL */
wire [8:0] burst_m1 = burst_len - 9'd1;  // a burst is at most 256 beats
/* verilator lint_on UNUSEDSIGNAL */
wire [FIFO_AW:0] fifo_count [0:STREAMS-1];

wire queue_empty;
wire [QUEUE_AW:0] queue_count;
wire [SW+7:0] queue_head;
reg all_requested;
integer si;
always @* begin
    all_requested = 1'b1;
    for (si = 0; si < STREAMS; si = si + 1) begin
        if (left_reg[si] != 0) all_requested = 1'b0;
    end
end
// the queue's room and the B count's are registered: a clock stale, they are still exact when
// an issue is allowed (awvalid_reg is set for at least the clock after an issue)
wire issue = !start && !abort_reg && !awvalid_reg && go_reg && queue_room_reg && b_room_reg;

// ---------------------------------------------------------------- W
// The burst being sent moves from the queue into registers (timing: the FIFO to pop is
// chosen by a flip-flop, not through the queue's memory), and the W channel leaves from
// registers (a block RAM's clock-to-out, then the select among the streams, would not fit
// one clock with what follows the port): a beat moves from the head of the burst's FIFO
// into them whenever they are empty or being taken.
wire [SW-1:0] q_stream = queue_head[SW+7:8];
wire [7:0] q_len_m1 = queue_head[7:0];
reg cur_valid_reg;                  // a burst is being sent
reg [SW-1:0] cur_stream_reg;        // its stream
reg [STREAMS-1:0] cur_onehot_reg;   // the same, one hot
reg [7:0] cur_left_reg;             // its beats after the next
reg cur_last_reg;                   // cur_left_reg == 0: the next beat is its last
reg wvalid_reg;
reg [DATA_WIDTH-1:0] wdata_reg;
reg [STRB_WIDTH-1:0] wstrb_reg;
reg wlast_out_reg;
wire w_take = cur_valid_reg && (!wvalid_reg || m_axi_wready);  // a FIFO beat into the registers
wire cur_load = !queue_empty && (!cur_valid_reg || (w_take && cur_last_reg));
wire [DATA_WIDTH-1:0] fifo_head [0:STREAMS-1];
// the burst's FIFO head: an AND-OR with the one-hot stream's flip-flops. Each head is a
// flip-flop (HEAD_REG; timing: the block RAM's clock-to-out, then these three LUT levels on
// the ECP5, did not fit one clock)
reg [DATA_WIDTH-1:0] cur_head;
integer hi;
always @* begin
    cur_head = {DATA_WIDTH{1'b0}};
    for (hi = 0; hi < STREAMS; hi = hi + 1) begin
        cur_head = cur_head | (fifo_head[hi] & {DATA_WIDTH{cur_onehot_reg[hi]}});
    end
end

assign m_axi_wvalid = wvalid_reg;
assign m_axi_wdata = wdata_reg;
assign m_axi_wstrb = wstrb_reg;
assign m_axi_wlast = wlast_out_reg;

l2l_optim_fifo #(.WIDTH(SW+8), .DEPTH(QUEUE_DEPTH)) queue_fifo (
    .clk(clk), .rst(rst), .clear(start),
    .push(issue), .push_data({sel_reg, burst_m1[7:0]}),
    .pop(cur_load), .head(queue_head), .empty(queue_empty), .count(queue_count)
);

// (b_pending_reg counts every burst until its B response, so its W beats too)
assign idle = (all_requested || abort_reg) && !awvalid_reg && queue_empty && (b_pending_reg == 0);
assign error = m_axi_bvalid && m_axi_bresp[1];

genvar k;
generate
for (k = 0; k < STREAMS; k = k + 1) begin : g_stream
    wire pop = w_take && cur_onehot_reg[k];
    wire fifo_empty;

    l2l_optim_fifo #(.WIDTH(DATA_WIDTH), .DEPTH(FIFO_DEPTH), .HEAD_REG(1)) data_fifo (
        .clk(clk), .rst(rst), .clear(start),
        .push(push[k]), .push_data(push_data[DATA_WIDTH*k +: DATA_WIDTH]),
        .pop(pop), .head(fifo_head[k]), .empty(fifo_empty), .count(fifo_count[k])
    );
`ifndef SYNTHESIS
    // an issued burst's beats are in its FIFO: the first pops three clocks after the head
    // could first show it (HEAD_REG), so a pop never finds the head empty
    reg reset_seen;
    initial reset_seen = 1'b0;
    always @(posedge clk) begin
        if (rst) begin
            reset_seen <= 1'b1;
        end else if (reset_seen && pop && fifo_empty) begin
            $fatal(1, "l2l_optim_writer: stream %0d popped with its FIFO head empty", k);
        end
    end
`else
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused_empty = fifo_empty;
    /* verilator lint_on UNUSEDSIGNAL */
`endif
    assign count[(FIFO_AW+1)*k +: FIFO_AW+1] = fifo_count[k];

    wire [12:0] page_beats_left = (13'd4096 - {1'b0, addr_reg[k][11:0]}) >> BYTE_SHIFT;
    wire [12:0] burst_max = {4'd0, stream_burst[9*k +: 9]};
    // FIFO beats not claimed by a burst, registered: it settles with the plan's first stage
    reg [15:0] avail_reg;

    always @(posedge clk) begin
        page_reg[k] <= page_beats_left;
        first_reg[k] <= (left_reg[k] < {19'd0, burst_max}) ? left_reg[k][8:0] : burst_max[8:0];
        len_reg[k] <= (page_reg[k] < {4'd0, first_reg[k]}) ? page_reg[k][8:0] : first_reg[k];
        avail_reg <= pushed_reg[k] - claimed_reg[k];
        ready_reg[k] <= (left_reg[k] != 0) && ({7'd0, len_reg[k]} <= avail_reg);
        settle_reg[k] <= (start || (issue && sel_onehot_reg[k])) ? 3'b000 : {settle_reg[k][1:0], 1'b1};

        if (push[k]) begin
            pushed_reg[k] <= pushed_reg[k] + 16'd1;
        end
        if (issue && sel_onehot_reg[k]) begin  // its own len_reg is burst_len
            claimed_reg[k] <= claimed_reg[k] + {7'd0, len_reg[k]};
            addr_reg[k] <= addr_reg[k] + ({{(ADDR_WIDTH-9){1'b0}}, len_reg[k]} << BYTE_SHIFT);
            left_reg[k] <= left_reg[k] - {23'd0, len_reg[k]};
        end
        if (pop) begin
            wleft_reg[k] <= wleft_reg[k] - 32'd1;
            wlast_reg[k] <= (wleft_reg[k] == 32'd2);
        end
        if (start) begin
            addr_reg[k] <= stream_addr[ADDR_WIDTH*k +: ADDR_WIDTH];
            left_reg[k] <= stream_enable[k] ? stream_beats[32*k +: 32] : 32'd0;
            wleft_reg[k] <= stream_enable[k] ? stream_beats[32*k +: 32] : 32'd0;
            wlast_reg[k] <= stream_enable[k] && stream_beats[32*k +: 32] == 32'd1;
            pushed_reg[k] <= 16'd0;
            claimed_reg[k] <= 16'd0;
        end
        if (rst) begin
            left_reg[k] <= 32'd0;
            wleft_reg[k] <= 32'd0;
            pushed_reg[k] <= 16'd0;
            claimed_reg[k] <= 16'd0;
            settle_reg[k] <= 3'b000;
            wlast_reg[k] <= 1'b0;
        end
    end
end
endgenerate

always @(posedge clk) begin
    if (awvalid_reg && m_axi_awready) begin
        awvalid_reg <= 1'b0;
    end

    if (issue) begin
        awvalid_reg <= 1'b1;
        awaddr_reg <= cur_addr;
        awlen_reg <= burst_m1[7:0];
    end
    // visit the streams round robin: after a burst, or while this one waits
    if (!awvalid_reg) begin
        s_reg <= (s_reg == LAST_STREAM) ? {SW{1'b0}} : s_reg + 1'b1;
    end
    go_reg <= !start && ready_reg[s_reg] && settle_reg[s_reg][2];
    sel_reg <= s_reg;
    sel_onehot_reg <= {{(STREAMS-1){1'b0}}, 1'b1} << s_reg;

    b_pending_reg <= b_pending_reg + {{15{m_axi_bvalid && !issue}}, m_axi_bvalid != issue};
    abort_reg <= abort;
    queue_room_reg <= (queue_count < QUEUE_DEPTH);
    b_room_reg <= (b_pending_reg != 16'hFFFF);

    if (cur_load) begin
        cur_valid_reg <= 1'b1;
        cur_stream_reg <= q_stream;
        cur_onehot_reg <= {{(STREAMS-1){1'b0}}, 1'b1} << q_stream;
        cur_left_reg <= q_len_m1;
        cur_last_reg <= (q_len_m1 == 8'd0);
    end else if (w_take) begin
        cur_valid_reg <= !cur_last_reg;
        cur_left_reg <= cur_left_reg - 8'd1;
        cur_last_reg <= (cur_left_reg == 8'd1);
    end
    if (w_take) begin
        wvalid_reg <= 1'b1;
        wdata_reg <= cur_head;
        wstrb_reg <= wlast_reg[cur_stream_reg] ? stream_last_strb[STRB_WIDTH*cur_stream_reg +: STRB_WIDTH]
                                               : {STRB_WIDTH{1'b1}};
        wlast_out_reg <= cur_last_reg;
    end else if (m_axi_wready) begin
        wvalid_reg <= 1'b0;
    end

    if (rst || start) begin
        s_reg <= {SW{1'b0}};
        cur_valid_reg <= 1'b0;
    end
    if (rst) begin
        awvalid_reg <= 1'b0;
        wvalid_reg <= 1'b0;
        b_pending_reg <= 16'd0;
        abort_reg <= 1'b1;
        go_reg <= 1'b0;
    end
end

endmodule

`resetall
