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

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_fifo #
(
    parameter WIDTH = 64,
    parameter DEPTH = 128,
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
reg [ADDR_WIDTH-1:0] rd_ptr_reg;   // the read address (count_reg, not the pointers, says how full)
reg [ADDR_WIDTH-1:0] rd_next_reg;  // rd_ptr_reg + 1
reg [ADDR_WIDTH:0] count_reg;  // wr_ptr_reg - rd_ptr_reg
reg empty_reg;                 // count_reg == 0

assign head = mem[rd_ptr_reg];
assign count = count_reg;
assign empty = empty_reg;
// the count's successors, from the register alone (push and pop select among them)
wire [ADDR_WIDTH:0] count_up = count_reg + 1'b1;
wire [ADDR_WIDTH:0] count_down = count_reg - 1'b1;

always @(posedge clk) begin
    if (push) begin
        mem[wr_ptr_reg[ADDR_WIDTH-1:0]] <= push_data;
    end
end

always @(posedge clk) begin
    if (push) begin
        wr_ptr_reg <= wr_ptr_reg + 1'b1;
    end
    if (pop) begin
        rd_ptr_reg <= rd_next_reg;
        rd_next_reg <= rd_next_reg + 1'b1;
    end
    if (push != pop) begin
        count_reg <= push ? count_up : count_down;
    end
    // empty after this clock: no push, and either the one beat left is popped or it was empty
    empty_reg <= !push && (pop ? (count_reg == {{ADDR_WIDTH{1'b0}}, 1'b1}) : empty_reg);
    if (rst || clear) begin
        wr_ptr_reg <= 0;
        rd_ptr_reg <= 0;
        rd_next_reg <= 1;
        count_reg <= 0;
        empty_reg <= 1'b1;
    end
end

endmodule

`resetall
