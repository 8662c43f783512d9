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
// abort stops new bursts; the W beats and B responses of issued bursts are
// still completed, then the engine reports idle.

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
reg [15:0] committed_reg [0:STREAMS-1];  // FIFO beats promised to issued bursts
reg [SW-1:0] s_reg;

reg awvalid_reg;
reg [ADDR_WIDTH-1:0] awaddr_reg;
reg [7:0] awlen_reg;
reg [15:0] b_pending_reg;
reg [7:0] wbeat_reg;

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
wire [ADDR_WIDTH-1:0] cur_addr = addr_reg[s_reg];
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
wire [8:0] burst_len = len_reg[s_reg];
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
wire issue = !start && !abort && !awvalid_reg && ready_reg[s_reg] && settle_reg[s_reg][2]
             && (queue_count < QUEUE_DEPTH) && (b_pending_reg != 16'hFFFF);

// ---------------------------------------------------------------- W
wire [SW-1:0] w_stream = queue_head[SW+7:8];
wire [7:0] w_len_m1 = queue_head[7:0];
wire w_hs = m_axi_wvalid && m_axi_wready;
wire w_last = (wbeat_reg == w_len_m1);
wire [DATA_WIDTH-1:0] fifo_head [0:STREAMS-1];

assign m_axi_wvalid = !queue_empty;
assign m_axi_wdata = fifo_head[w_stream];
assign m_axi_wstrb = wlast_reg[w_stream] ? stream_last_strb[STRB_WIDTH*w_stream +: STRB_WIDTH]
                                                    : {STRB_WIDTH{1'b1}};
assign m_axi_wlast = w_last;

l2l_optim_fifo #(.WIDTH(SW+8), .DEPTH(QUEUE_DEPTH)) queue_fifo (
    .clk(clk), .rst(rst), .clear(start),
    .push(issue), .push_data({s_reg, burst_m1[7:0]}),
    .pop(w_hs && w_last), .head(queue_head), .empty(queue_empty), .count(queue_count)
);

assign idle = (all_requested || abort) && !awvalid_reg && queue_empty && (b_pending_reg == 0);
assign error = m_axi_bvalid && m_axi_bresp[1];

genvar k;
generate
for (k = 0; k < STREAMS; k = k + 1) begin : g_stream
    wire pop = w_hs && (w_stream == k);
    wire fifo_empty;

    l2l_optim_fifo #(.WIDTH(DATA_WIDTH), .DEPTH(FIFO_DEPTH)) data_fifo (
        .clk(clk), .rst(rst), .clear(start),
        .push(push[k]), .push_data(push_data[DATA_WIDTH*k +: DATA_WIDTH]),
        .pop(pop), .head(fifo_head[k]), .empty(fifo_empty), .count(fifo_count[k])
    );
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused_empty = fifo_empty;
    /* verilator lint_on UNUSEDSIGNAL */
    assign count[(FIFO_AW+1)*k +: FIFO_AW+1] = fifo_count[k];

    wire [12:0] page_beats_left = (13'd4096 - {1'b0, addr_reg[k][11:0]}) >> BYTE_SHIFT;
    wire [12:0] burst_max = {4'd0, stream_burst[9*k +: 9]};
    wire [15:0] avail = {{(15-FIFO_AW){1'b0}}, fifo_count[k]} - committed_reg[k];

    always @(posedge clk) begin
        page_reg[k] <= page_beats_left;
        first_reg[k] <= (left_reg[k] < {19'd0, burst_max}) ? left_reg[k][8:0] : burst_max[8:0];
        len_reg[k] <= (page_reg[k] < {4'd0, first_reg[k]}) ? page_reg[k][8:0] : first_reg[k];
        ready_reg[k] <= (left_reg[k] != 0) && ({7'd0, len_reg[k]} <= avail);
        settle_reg[k] <= (start || (issue && s_reg == k)) ? 3'b000 : {settle_reg[k][1:0], 1'b1};

        committed_reg[k] <= committed_reg[k] + ((issue && s_reg == k) ? {7'd0, burst_len} : 16'd0)
                            - {15'd0, pop};
        if (issue && s_reg == k) begin
            addr_reg[k] <= addr_reg[k] + ({{(ADDR_WIDTH-9){1'b0}}, burst_len} << BYTE_SHIFT);
            left_reg[k] <= left_reg[k] - {23'd0, burst_len};
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
            committed_reg[k] <= 16'd0;
        end
        if (rst) begin
            left_reg[k] <= 32'd0;
            wleft_reg[k] <= 32'd0;
            committed_reg[k] <= 16'd0;
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

    b_pending_reg <= b_pending_reg + {15'd0, issue} - {15'd0, m_axi_bvalid};

    if (w_hs) begin
        wbeat_reg <= w_last ? 8'd0 : wbeat_reg + 8'd1;
    end

    if (rst || start) begin
        s_reg <= {SW{1'b0}};
        wbeat_reg <= 8'd0;
    end
    if (rst) begin
        awvalid_reg <= 1'b0;
        b_pending_reg <= 16'd0;
    end
end

endmodule

`resetall
