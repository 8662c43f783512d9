// SPDX-License-Identifier: Apache-2.0
// Read side of l2l_optim: AXI4 AR/R burst engine feeding one FIFO per stream.
//
// Streams 0..5 = param, m, v, grad, m scales, v scales (the last two with the
// 8-bit state). The engine walks the arrays tile by tile:
// for each tile it requests TILE_BEATS[s] beats of every enabled stream in
// turn (p, m, v, g, ...), as INCR bursts split at 4 KiB boundaries (pointers are
// DATA_WIDTH/8 aligned, so a split is all that is needed). All reads use ID 0,
// so the R beats come back in request order; a small route FIFO remembers the
// stream and length of every burst in flight.
//
// Credit: a burst is requested only when its stream FIFO has room for all of
// it, counting beats already in flight (reserved). R data therefore never
// waits (rready is always 1), and with requests issued strictly in order a
// stream can never starve another: every beat the datapath waits for has
// been requested before any beat that waits for space. A stream marked
// `stream_ahead` (the block scales: one beat covers many tiles of the others,
// so its one-beat tiles run ahead) is skipped for the round when its FIFO is
// full instead of being waited for: a full FIFO holds what the datapath needs.
//
// Sizing (see docs/RTL_KERNEL.md): the stream FIFOs hold FIFO_DEPTH beats =
// 2 tiles, so one tile of every stream can be in flight while the previous
// tile is consumed: up to 4 * TILE_BEATS beats outstanding, which covers
// L cycles of read latency at one beat per clock while 4 * 64 = 256 > 100 + 64.
//
// abort stops new requests (a clock late: it is registered here, as its fan-out is wide); the
// beats of requests already issued are still accepted, then the engine reports idle.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_reader #
(
    parameter DATA_WIDTH = 64,
    parameter ADDR_WIDTH = 64,
    parameter ID_WIDTH = 1,
    parameter FIFO_DEPTH = 128,
    parameter ROUTE_DEPTH = 32,
    parameter STREAMS = 6,
    parameter STRB_WIDTH = (DATA_WIDTH/8),
    parameter FIFO_AW = $clog2(FIFO_DEPTH)
)
(
    input  wire                        clk,
    input  wire                        rst,

    input  wire                        start,          // pulse: load the streams, clear FIFOs
    input  wire                        abort,          // level: request nothing more
    input  wire [STREAMS*ADDR_WIDTH-1:0] stream_addr,
    input  wire [STREAMS*32-1:0]       stream_beats,   // total beats per stream
    input  wire [STREAMS*9-1:0]        stream_tile,    // beats per tile per stream (1..256)
    input  wire [STREAMS-1:0]          stream_enable,
    input  wire [STREAMS-1:0]          stream_ahead,   // skip the stream's tile while its FIFO is full
    output wire                        idle,           // nothing to request, nothing in flight
    output wire                        error,          // pulse: an R beat with SLVERR/DECERR

    input  wire [STREAMS-1:0]          pop,
    output wire [STREAMS*DATA_WIDTH-1:0] head,
    output wire [STREAMS-1:0]          empty,

    /*
     * AXI4 master, read channels
     */
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
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [ID_WIDTH-1:0]         m_axi_rid,
    input  wire                        m_axi_rlast,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire [DATA_WIDTH-1:0]       m_axi_rdata,
    /* verilator lint_off UNUSEDSIGNAL */
    input  wire [1:0]                  m_axi_rresp,
    /* verilator lint_on UNUSEDSIGNAL */
    input  wire                        m_axi_rvalid,
    output wire                        m_axi_rready
);

localparam BYTE_SHIFT = $clog2(STRB_WIDTH);
localparam ROUTE_AW = $clog2(ROUTE_DEPTH);
localparam SW = $clog2(STREAMS);
localparam [SW-1:0] LAST_STREAM = STREAMS - 1;

reg [ADDR_WIDTH-1:0] addr_reg [0:STREAMS-1];
reg [31:0] left_reg [0:STREAMS-1];
reg [15:0] resv_reg [0:STREAMS-1];  // beats in the FIFO or in flight
reg [STREAMS-1:0] pop_reg;          // pop, a clock late
reg [SW-1:0] s_reg;
reg [STREAMS-1:0] s_onehot_reg;  // s_reg, one hot (timing: the issue's per-stream enables)
wire [SW-1:0] s_next = (s_reg == LAST_STREAM) ? {SW{1'b0}} : s_reg + 1'b1;
reg tile_loaded_reg;
reg [8:0] tleft_reg;

reg arvalid_reg;
reg [ADDR_WIDTH-1:0] araddr_reg;
reg [7:0] arlen_reg;

assign m_axi_arid = {ID_WIDTH{1'b0}};
assign m_axi_araddr = araddr_reg;
assign m_axi_arlen = arlen_reg;
assign m_axi_arsize = BYTE_SHIFT[2:0];
assign m_axi_arburst = 2'b01;
assign m_axi_arlock = 1'b0;
assign m_axi_arcache = 4'b0011;
assign m_axi_arprot = 3'b010;
assign m_axi_arvalid = arvalid_reg;
assign m_axi_rready = 1'b1;

// ---------------------------------------------------------------- requests
// The next burst is planned in registers, four clocks deep (timing: one carry chain per
// clock, and the select among the streams in a clock of its own): per stream, the beats to
// its 4 KiB page end and its FIFO's free space; then those of stream s_reg; then the burst's
// length (page, rest of the tile); then whether its FIFO has room. The plan is used only
// once the state it was made from has been stable for four clocks (settle_reg); in between,
// the FIFO only drains, so a stale "room" is conservative. That the plan allows a burst is
// itself a register (ready_reg, a clock later; timing: the issue is then an AND of four
// flip-flops, and it loads the stream select and the AR registers).
wire [ADDR_WIDTH-1:0] cur_addr = addr_reg[s_reg];
reg [12:0] page_k_reg [0:STREAMS-1];  // per stream: beats from its address to its page end
reg [16:0] space_k_reg [0:STREAMS-1]; // per stream: FIFO_DEPTH minus its reservations
reg [12:0] page_beats_left; // beats from cur_addr to its 4 KiB page end
reg [16:0] space_reg;       // FIFO_DEPTH minus the stream's reservations
reg [8:0] tile_burst_len;   // the plan: beats of the next burst of stream s_reg
reg room_reg;               // its FIFO has room for them
/* verilator lint_off UNUSEDSIGNAL */
reg [8:0] tile_burst_m1_reg; // tile_burst_len - 1, a clock later (with room_reg); a burst is at most 256 beats
/* verilator lint_on UNUSEDSIGNAL */
reg [3:0] settle_reg;
reg ready_reg;  // a tile is loaded, its plan settled, with room in its FIFO and the route FIFO
// The tile loader's decisions per stream, registered (a clock stale: a stream's state changes
// only at its own issue, and the loader comes back to it no sooner than STREAMS clocks later;
// start clears left_nz_reg, so a stale one never loads a tile)
reg [STREAMS-1:0] left_nz_reg;        // beats left to request
reg [STREAMS-1:0] ahead_ok_reg;       // not running ahead, or room for its tile
reg [8:0] tile_first_reg [0:STREAMS-1]; // its next tile's beats: min(beats left, tile)
reg abort_reg;                        // abort, a clock late
reg all_requested;
integer si;
always @* begin
    all_requested = 1'b1;
    for (si = 0; si < STREAMS; si = si + 1) begin
        if (left_reg[si] != 0) all_requested = 1'b0;
    end
end
wire issue;

// route FIFO: {stream, beats - 1} of every burst in flight
wire [SW+7:0] route_head;
wire route_empty;
wire [ROUTE_AW:0] route_count;
wire rcur_load;  // the route FIFO's head into the registers of the arriving burst (below)

l2l_optim_fifo #(.WIDTH(SW+8), .DEPTH(ROUTE_DEPTH)) route_fifo (
    .clk(clk), .rst(rst), .clear(start),
    .push(issue), .push_data({s_reg, tile_burst_m1_reg[7:0]}),
    .pop(rcur_load), .head(route_head), .empty(route_empty), .count(route_count)
);

// the route FIFO's room and whether the burst ends its tile are registered too: a clock
// stale, they are still exact when an issue is allowed (no issue in the clocks before it)
reg route_room_reg;
reg tile_end_reg;
// start is not in it (timing: start fans out to every FIFO): in start's clock every register
// an issue loads is loaded by start instead, except arvalid_reg, which start gates itself
assign issue = !abort_reg && !arvalid_reg && ready_reg;
assign idle = (all_requested || abort_reg) && !arvalid_reg && route_empty && !rcur_valid_reg;

// ---------------------------------------------------------------- data
// The burst whose beats arrive moves from the route FIFO into registers (timing: the FIFO an
// R beat goes to is chosen by a flip-flop, not through the route FIFO's memory). Its entry
// is in the route FIFO a clock after the AR request and is loaded in the next clock, or with
// the last beat of the burst before: before any of its beats can arrive.
wire r_hs = m_axi_rvalid;  // rready is 1
wire [SW-1:0] r_stream = route_head[SW+7:8];
wire [7:0] r_len_m1 = route_head[7:0];
reg rcur_valid_reg;                 // a burst is arriving
reg [STREAMS-1:0] rcur_onehot_reg;  // its stream, one hot
reg [7:0] rcur_left_reg;            // its beats after the next
reg rcur_last_reg;                  // rcur_left_reg == 0: the next beat is its last
assign rcur_load = !route_empty && (!rcur_valid_reg || (r_hs && rcur_last_reg));
assign error = r_hs && m_axi_rresp[1];

genvar k;
generate
for (k = 0; k < STREAMS; k = k + 1) begin : g_stream
    wire [FIFO_AW:0] count;
    l2l_optim_fifo #(.WIDTH(DATA_WIDTH), .DEPTH(FIFO_DEPTH)) data_fifo (
        .clk(clk), .rst(rst), .clear(start),
        .push(r_hs && rcur_onehot_reg[k]), .push_data(m_axi_rdata),
        .pop(pop[k]), .head(head[DATA_WIDTH*k +: DATA_WIDTH]), .empty(empty[k]),
        .count(count)
    );
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused_count = ^count;
    /* verilator lint_on UNUSEDSIGNAL */

    wire [8:0] tile_k = stream_tile[9*k +: 9];
    always @(posedge clk) begin
        page_k_reg[k] <= (13'd4096 - {1'b0, addr_reg[k][11:0]}) >> BYTE_SHIFT;
        space_k_reg[k] <= {1'b0, FIFO_DEPTH[15:0]} - {1'b0, resv_reg[k]};
        left_nz_reg[k] <= (left_reg[k] != 0) && !start;
        ahead_ok_reg[k] <= !(stream_ahead[k] && resv_reg[k] + {7'd0, tile_k} > FIFO_DEPTH[15:0]);
        tile_first_reg[k] <= (left_reg[k] < {23'd0, tile_k}) ? left_reg[k][8:0] : tile_k;
        // a pop leaves the reservation a clock late (timing: pop comes from the kernel's
        // issue logic): one beat too many reserved for a clock, which is conservative
        pop_reg[k] <= pop[k] && !start;
        // one carry chain each (the burst's length less one is a register of the plan)
        if (issue && s_onehot_reg[k]) begin
            resv_reg[k] <= resv_reg[k] + (pop_reg[k] ? {7'd0, tile_burst_m1_reg} : {7'd0, tile_burst_len});
        end else if (pop_reg[k]) begin
            resv_reg[k] <= resv_reg[k] - 16'd1;
        end
        if (issue && s_onehot_reg[k]) begin
            addr_reg[k] <= addr_reg[k] + ({{(ADDR_WIDTH-9){1'b0}}, tile_burst_len} << BYTE_SHIFT);
            left_reg[k] <= left_reg[k] - {23'd0, tile_burst_len};
        end
        if (start) begin
            addr_reg[k] <= stream_addr[ADDR_WIDTH*k +: ADDR_WIDTH];
            left_reg[k] <= stream_enable[k] ? stream_beats[32*k +: 32] : 32'd0;
            resv_reg[k] <= 16'd0;
        end
        if (rst) begin
            left_reg[k] <= 32'd0;
            resv_reg[k] <= 16'd0;
            pop_reg[k] <= 1'b0;
        end
    end
end
endgenerate

always @(posedge clk) begin
    page_beats_left <= page_k_reg[s_reg];
    space_reg <= space_k_reg[s_reg];
    tile_burst_len <= (page_beats_left < {4'd0, tleft_reg}) ? page_beats_left[8:0] : tleft_reg;
    room_reg <= !space_reg[16] && {8'd0, tile_burst_len} <= space_reg;
    tile_burst_m1_reg <= tile_burst_len - 9'd1;
    route_room_reg <= (route_count < ROUTE_DEPTH);
    tile_end_reg <= (tleft_reg == tile_burst_len);
    // the state the plan reads changes at an issue and at every step of the tile loader
    settle_reg <= (issue || !tile_loaded_reg) ? 4'b0000 : {settle_reg[2:0], 1'b1};
    ready_reg <= !issue && tile_loaded_reg && settle_reg[3] && room_reg && route_room_reg;
    abort_reg <= abort;

    if (arvalid_reg && m_axi_arready) begin
        arvalid_reg <= 1'b0;
    end

    if (!tile_loaded_reg) begin
        // next stream with beats left (and, running ahead, room for its tile): load its tile
        if (left_nz_reg[s_reg] && ahead_ok_reg[s_reg]) begin
            tile_loaded_reg <= 1'b1;
            tleft_reg <= tile_first_reg[s_reg];
        end else begin
            s_reg <= s_next;
            s_onehot_reg <= {s_onehot_reg[STREAMS-2:0], s_onehot_reg[STREAMS-1]};
        end
    end else if (issue) begin
        arvalid_reg <= !start;
        araddr_reg <= cur_addr;
        arlen_reg <= tile_burst_m1_reg[7:0];
        tleft_reg <= tleft_reg - tile_burst_len;
        if (tile_end_reg) begin
            tile_loaded_reg <= 1'b0;
            s_reg <= s_next;
            s_onehot_reg <= {s_onehot_reg[STREAMS-2:0], s_onehot_reg[STREAMS-1]};
        end
    end

    if (rcur_load) begin
        rcur_valid_reg <= 1'b1;
        rcur_onehot_reg <= {{(STREAMS-1){1'b0}}, 1'b1} << r_stream;
        rcur_left_reg <= r_len_m1;
        rcur_last_reg <= (r_len_m1 == 8'd0);
    end else if (r_hs) begin
        rcur_valid_reg <= !rcur_last_reg;
        rcur_left_reg <= rcur_left_reg - 8'd1;
        rcur_last_reg <= (rcur_left_reg == 8'd1);
    end

    if (rst || start) begin
        s_reg <= {SW{1'b0}};
        s_onehot_reg <= {{(STREAMS-1){1'b0}}, 1'b1};
        tile_loaded_reg <= 1'b0;
        rcur_valid_reg <= 1'b0;
        settle_reg <= 4'b0000;
        ready_reg <= 1'b0;
    end
    if (rst) begin
        arvalid_reg <= 1'b0;
        abort_reg <= 1'b1;
    end
end

endmodule

`resetall
