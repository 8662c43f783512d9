// SPDX-License-Identifier: Apache-2.0
// Synchronous first-word-fall-through FIFO with an occupancy count.
//
// DEPTH must be a power of two. `clear` empties it (start of a run). Pushing
// into a full FIFO or popping an empty one is a caller error; the kernel
// never does either because it reserves space (credit) before it asks for
// data. Read is asynchronous from the array (LUT RAM / registers).
// Timing: `count` and `empty` are registers of their own, kept with the
// pointers (not their difference and comparison), so a reader of either
// starts its logic at a flip-flop. The read pointer's successor is a register
// too: a pop only selects the next read address (a block RAM's address is the
// pointer's next value), with no carry chain after it. Likewise the count: its
// successors up and down come from the register, and push and pop only select.
//
// HEAD_REG = 1: the head is a flip-flop, not the memory's read port. The memory is read
// synchronously into its port (`fetch`), and the word moves on into `head` (or, while the head
// is held, into a skid register); a fetch is made whenever the port, the head and the skid
// would hold at most two words after this clock, so a pop every clock finds a new head
// (II=1) and a stall loses nothing. A push reaches the head three clocks later. For a FIFO in
// block RAM whose head feeds logic: the RAM's clock-to-out (4.3 ns on the ECP5) then ends at
// a register (one 2:1 select), and the logic after the head starts at a flip-flop.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_fifo #
(
    parameter WIDTH = 64,
    parameter DEPTH = 128,
    parameter HEAD_REG = 0,
    parameter ADDR_WIDTH = $clog2(DEPTH)
)
(
    input  wire                clk,
    input  wire                rst,
    input  wire                clear,

    input  wire                push,
    input  wire [WIDTH-1:0]    push_data,

    input  wire                pop,
    output wire [WIDTH-1:0]    head,
    output wire                empty,

    output wire [ADDR_WIDTH:0] count
);

reg [WIDTH-1:0] mem [0:DEPTH-1];
reg [ADDR_WIDTH:0] wr_ptr_reg;
reg [ADDR_WIDTH-1:0] rd_ptr_reg;   // the read address (the counts, not the pointers, say how full)
reg [ADDR_WIDTH-1:0] rd_next_reg;  // rd_ptr_reg + 1
reg [ADDR_WIDTH:0] count_reg;  // words pushed and not popped
reg empty_reg;                 // count_reg == 0

assign count = count_reg;
// the count's successors, from the register alone (push and pop select among them)
wire [ADDR_WIDTH:0] count_up = count_reg + 1'b1;
wire [ADDR_WIDTH:0] count_down = count_reg - 1'b1;
// the memory's read: a pop (HEAD_REG = 0) or a fetch (HEAD_REG = 1) moves the read address
wire read;

always @(posedge clk) begin
    if (push) begin
        mem[wr_ptr_reg[ADDR_WIDTH-1:0]] <= push_data;
    end
end

always @(posedge clk) begin
    if (push) begin
        wr_ptr_reg <= wr_ptr_reg + 1'b1;
    end
    if (read) begin
        rd_ptr_reg <= rd_next_reg;
        rd_next_reg <= rd_next_reg + 1'b1;
    end
    if (push != pop) begin
        count_reg <= push ? count_up : count_down;
    end
    // empty after this clock: no push, and either the one word left is popped or it was empty
    empty_reg <= !push && (pop ? (count_reg == {{ADDR_WIDTH{1'b0}}, 1'b1}) : empty_reg);
    if (rst || clear) begin
        wr_ptr_reg <= 0;
        rd_ptr_reg <= 0;
        rd_next_reg <= 1;
        count_reg <= 0;
        empty_reg <= 1'b1;
    end
end

generate
if (HEAD_REG == 0) begin : g_read_port
    assign read = pop;
    assign head = mem[rd_ptr_reg];
    assign empty = empty_reg;
end else begin : g_head_reg
    reg [ADDR_WIDTH:0] stored_reg;  // words in the memory not yet fetched
    reg stored_empty_reg;           // stored_reg == 0
    reg [WIDTH-1:0] port_reg;       // the memory's read port
    reg port_valid_reg;             // it holds the word fetched last clock
    reg [WIDTH-1:0] head_reg;
    reg head_valid_reg;
    reg [WIDTH-1:0] skid_reg;       // the word after the head, while the head is held
    reg skid_valid_reg;
    wire [1:0] held = {1'b0, port_valid_reg} + {1'b0, head_valid_reg} + {1'b0, skid_valid_reg};
    wire fetch = !stored_empty_reg && (held <= 2'd1 || (held == 2'd2 && pop));
    wire [ADDR_WIDTH:0] stored_up = stored_reg + 1'b1;
    wire [ADDR_WIDTH:0] stored_down = stored_reg - 1'b1;
    assign read = fetch;
    assign head = head_reg;
    assign empty = !head_valid_reg;

    always @(posedge clk) begin
        port_reg <= mem[rd_ptr_reg];  // read every clock: only a fetched word is used
        port_valid_reg <= fetch;
        if (push != fetch) begin
            stored_reg <= push ? stored_up : stored_down;
        end
        stored_empty_reg <= !push && (fetch ? (stored_reg == {{ADDR_WIDTH{1'b0}}, 1'b1}) : stored_empty_reg);
        // a free head takes the skid's word, else the port's (at most two of the three are
        // valid, so a full skid means an empty port); a held head leaves the port's to the skid
        if (pop || !head_valid_reg) begin
            head_reg <= skid_valid_reg ? skid_reg : port_reg;
            head_valid_reg <= skid_valid_reg || port_valid_reg;
            skid_valid_reg <= 1'b0;
        end else if (port_valid_reg) begin
            skid_reg <= port_reg;
            skid_valid_reg <= 1'b1;
        end
        if (rst || clear) begin
            stored_reg <= 0;
            stored_empty_reg <= 1'b1;
            port_valid_reg <= 1'b0;
            head_valid_reg <= 1'b0;
            skid_valid_reg <= 1'b0;
        end
    end
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused_empty = empty_reg;
    /* verilator lint_on UNUSEDSIGNAL */
end
endgenerate

endmodule

`resetall
