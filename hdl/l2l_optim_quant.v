// SPDX-License-Identifier: Apache-2.0
// Encode one slot (m or v) of the updated state into 8-bit codes with one scale
// per block: golden.quantize, streaming.
//
// Groups of LANES fp32 values come in (element e in lane e % LANES of group
// e / LANES, as in l2l_optim); a block is QUANT_BLOCK elements = BLOCK_GROUPS
// groups, the run's last block may be shorter (in_last ends it; in_mask marks
// the lanes of the last group beyond n, which count as +0 in the block's
// maximum, as golden's zero padding). Per block:
//   fill   every group is written to one half of a double buffer while the
//          block's max |x| bits are reduced (a tree over the lanes, then a
//          running max); the other half drains meanwhile, so the input never
//          waits;
//   scale  k = block_exponent(absmax): absmax rounded (to nearest even, on its
//          bits) to CODE_MAN_BITS mantissa bits, exponent clamped to
//          +-SCALE_EXP_LIMIT; scale 2^k, or NaN (0x7FC00000) if the block holds
//          Inf or NaN (absmax >= 0x7F800000);
//   drain  each buffered group, one per clock: y = x * 2^-k (fp32_mul, as golden),
//          then encode_codes: round to nearest even on the magnitude
//          (normal grid), or round the exact y * 2^(BIAS - 1 + CODE_MAN_BITS) to an
//          integer (subnormal grid), saturate at the largest code, sign in bit 7
//          if SIGNED; all codes 0 in a NaN block.
// Outputs: scale_valid with the block's scale at the start of its drain, then
// BLOCK_GROUPS (or fewer) out_valid groups of codes, QUANT_DRAIN_LATENCY clocks
// behind (hdl/l2l_optim_state8.vh). A block's drain starts BLOCK_LATENCY clocks
// after its last group came in, or when the drain before it ends (only a short
// last block can find it busy).

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_quant #
(
    parameter LANES = 1,
    parameter EXP_BITS = 4,
    parameter SIGNED = 1
)
(
    input  wire                  clk,
    input  wire                  rst,
    input  wire                  clear,        // start of a run

    input  wire                  in_valid,
    input  wire                  in_last,      // the run's last group
    input  wire [LANES-1:0]      in_mask,      // lanes holding an element
    input  wire [32*LANES-1:0]   in_x,

    output wire                  scale_valid,
    output wire                  scale_last,   // the run's last block
    output wire [31:0]           scale,

    output wire                  out_valid,
    output wire                  out_last,     // the run's last group
    output wire [8*LANES-1:0]    out_code,

    output wire [15:0]           held          // groups in whose codes have not come out
);

`include "fp_latency.vh"
`include "l2l_optim_regs.vh"  // QUANT_BLOCK
`include "l2l_optim_state8.vh"

localparam integer BLOCK_GROUPS = QUANT_BLOCK / LANES;
localparam integer GW = $clog2(BLOCK_GROUPS);
localparam integer TREE = $clog2(LANES);
// from a block's last group in to its drain's first buffer read: the masked magnitudes and
// the tree, the block's maximum, its exponent, the block queue, the drain's address register
localparam integer BLOCK_LATENCY = 1 + TREE + 1 + 1 + 1 + 1;
/* verilator lint_off UNUSEDPARAM */
localparam integer LATENCY = QUANT_DRAIN_LATENCY;
/* verilator lint_on UNUSEDPARAM */
localparam integer BIAS = (1 << EXP_BITS) - 1;
localparam integer DROP = 23 - CODE_MAN_BITS;
localparam integer MAX_MAG = (1 << (EXP_BITS + CODE_MAN_BITS)) - 1;
localparam [31:0] CANONICAL_NAN = 32'h7FC00000;

initial begin
    if (LANES < 1 || LANES > 16 || (LANES & (LANES-1)) != 0) begin
        $error("Error: LANES must be a power of two <= 16 (instance %m)");
        $finish;
    end
    // the drain of block b reads its half before block b+2 overwrites it
    if (BLOCK_LATENCY > BLOCK_GROUPS + 1) begin
        $error("Error: BLOCK_LATENCY %0d > BLOCK_GROUPS %0d + 1 (instance %m)", BLOCK_LATENCY, BLOCK_GROUPS);
        $finish;
    end
end

// ---------------------------------------------------------------- fill
reg half_reg;              // the half being filled
reg [GW-1:0] gi_reg;       // group of the block being filled
localparam integer LAST_GI_I = BLOCK_GROUPS - 1;
localparam [GW-1:0] LAST_GI = LAST_GI_I[GW-1:0];
wire block_end = in_valid && (in_last || gi_reg == LAST_GI);

reg [32*LANES-1:0] buffer [0:2*BLOCK_GROUPS-1];
always @(posedge clk) begin
    if (in_valid) begin
        buffer[{half_reg, gi_reg}] <= in_x;
    end
end

always @(posedge clk) begin
    if (in_valid) begin
        gi_reg <= block_end ? {GW{1'b0}} : gi_reg + 1'b1;
        if (block_end) begin
            half_reg <= !half_reg;
        end
    end
    if (rst || clear) begin
        gi_reg <= {GW{1'b0}};
        half_reg <= 1'b0;
    end
end

// ---------------------------------------------------------------- block maximum
// level 0: the masked magnitudes; level l: maxima of pairs of level l-1
reg [31*LANES-1:0] tree_reg [0:TREE];
integer li, ti;
always @(posedge clk) begin
    for (li = 0; li < LANES; li = li + 1) begin
        tree_reg[0][31*li +: 31] <= in_mask[li] ? in_x[32*li +: 31] : 31'd0;
    end
    for (ti = 1; ti <= TREE; ti = ti + 1) begin
        for (li = 0; li < (LANES >> ti); li = li + 1) begin
            tree_reg[ti][31*li +: 31] <= (tree_reg[ti-1][62*li +: 31] > tree_reg[ti-1][62*li + 31 +: 31])
                                         ? tree_reg[ti-1][62*li +: 31] : tree_reg[ti-1][62*li + 31 +: 31];
        end
    end
end
wire [30:0] group_max = tree_reg[TREE][30:0];

// the group's block position travels beside the tree: {valid, block end, run end, half, groups - 1}
wire t_valid, t_end, t_last, t_half;
wire [GW-1:0] t_gi;
l2l_optim_delay #(.WIDTH(GW + 4), .DEPTH(1 + TREE), .RESET(1)) tree_side (
    .clk(clk), .rst(rst || clear),
    .x({in_valid, block_end, in_valid && in_last, half_reg, gi_reg}),
    .y({t_valid, t_end, t_last, t_half, t_gi})
);

reg [30:0] run_max_reg;
wire [30:0] block_max = (group_max > run_max_reg) ? group_max : run_max_reg;
// the finished block: its maximum, then its exponent
reg blk_valid_reg, blk_last_reg, blk_half_reg;
reg [GW-1:0] blk_count_reg;   // groups - 1
reg [30:0] blk_max_reg;
always @(posedge clk) begin
    blk_valid_reg <= t_valid && t_end;
    if (t_valid) begin
        run_max_reg <= t_end ? 31'd0 : block_max;
    end
    if (t_valid && t_end) begin
        blk_max_reg <= block_max;
        blk_last_reg <= t_last;
        blk_half_reg <= t_half;
        blk_count_reg <= t_gi;
    end
    if (rst || clear) begin
        run_max_reg <= 31'd0;
        blk_valid_reg <= 1'b0;
    end
end

// block_exponent: round absmax to CODE_MAN_BITS mantissa bits (nearest even), its exponent
localparam integer K_MIN_I = 127 - SCALE_EXP_LIMIT, K_MAX_I = 127 + SCALE_EXP_LIMIT;
localparam [8:0] K_MIN = K_MIN_I[8:0];   // k + 127 at the clamps
localparam [8:0] K_MAX = K_MAX_I[8:0];
localparam [31:0] HALF_M1 = (32'd1 << (DROP - 1)) - 32'd1;
/* verilator lint_off UNUSEDSIGNAL */
wire [31:0] absmax_rounded = {1'b0, blk_max_reg} + HALF_M1 + {31'd0, blk_max_reg[DROP]};
/* verilator lint_on UNUSEDSIGNAL */
wire [8:0] k_biased = absmax_rounded[31:23];  // k + 127, before the clamp
/* verilator lint_off UNUSEDSIGNAL */
wire [8:0] k_clamped_w = (k_biased < K_MIN) ? K_MIN : (k_biased > K_MAX) ? K_MAX : k_biased;
/* verilator lint_on UNUSEDSIGNAL */
wire [7:0] k_clamped = k_clamped_w[7:0];  // 1..253
wire blk_bad = (blk_max_reg >= 31'h7F800000);
// the exponent and the block's fields, a clock later (timing: the rounding add and the clamp,
// then the inverse scale's subtraction, would be three carry chains in one clock)
reg exp_valid_reg, exp_last_reg, exp_half_reg, exp_bad_reg;
reg [GW-1:0] exp_count_reg;
reg [7:0] exp_k_reg;
always @(posedge clk) begin
    exp_valid_reg <= blk_valid_reg;
    exp_last_reg <= blk_last_reg;
    exp_half_reg <= blk_half_reg;
    exp_count_reg <= blk_count_reg;
    exp_bad_reg <= blk_bad;
    exp_k_reg <= k_clamped;
    if (rst || clear) begin
        exp_valid_reg <= 1'b0;
    end
end

// ---------------------------------------------------------------- block queue
// {last, half, groups - 1, bad, scale, inverse scale}; two entries: a short last block
// may end while the block before it drains
localparam integer DESC_W = 1 + 1 + GW + 1 + 32 + 32;
wire [DESC_W-1:0] desc_head;
wire desc_empty;
wire [1:0] desc_count;
reg desc_pop;
l2l_optim_fifo #(.WIDTH(DESC_W), .DEPTH(2)) desc_fifo (
    .clk(clk), .rst(rst), .clear(clear),
    .push(exp_valid_reg),
    .push_data({exp_last_reg, exp_half_reg, exp_count_reg, exp_bad_reg,
                {1'b0, exp_k_reg, 23'd0}, {1'b0, 8'd254 - exp_k_reg, 23'd0}}),
    .pop(desc_pop), .head(desc_head), .empty(desc_empty), .count(desc_count)
);
/* verilator lint_off UNUSEDSIGNAL */
wire unused_desc_count = ^desc_count;
/* verilator lint_on UNUSEDSIGNAL */
wire d_last = desc_head[DESC_W-1];
wire d_half = desc_head[DESC_W-2];
wire [GW-1:0] d_count = desc_head[DESC_W-3 -: GW];
wire d_bad = desc_head[64];
wire [31:0] d_scale = desc_head[63:32];
wire [31:0] d_inv = desc_head[31:0];

// ---------------------------------------------------------------- drain
reg draining_reg;
reg [GW-1:0] rd_gi_reg, rd_left_reg;
// rd_left_reg == 0: the group read now is the block's last (a register of its own, timing:
// the drain's start pops the block queue and pushes the scale into the kernel's FIFO)
reg rd_end_reg;
reg rd_half_reg, rd_last_reg, rd_bad_reg;
reg [31:0] rd_inv_reg;
wire drain_start = !desc_empty && (!draining_reg || rd_end_reg);
wire drain_read = draining_reg;
wire drain_end = draining_reg && rd_end_reg;

always @* begin
    desc_pop = drain_start;
end

assign scale_valid = drain_start;
assign scale_last = d_last;
assign scale = d_bad ? CANONICAL_NAN : d_scale;

// the buffer's read register, then one in the fabric: on the ECP5 a block RAM's clock to
// out is 4.3 ns, and the multiplier's operand checks behind it made the kernel's critical path
reg [32*LANES-1:0] x_reg, x_mul_reg;
always @(posedge clk) begin
    x_reg <= buffer[{rd_half_reg, rd_gi_reg}];
    x_mul_reg <= x_reg;
    if (drain_read) begin
        rd_gi_reg <= rd_gi_reg + 1'b1;
        rd_left_reg <= rd_left_reg - 1'b1;
        rd_end_reg <= (rd_left_reg == {{(GW-1){1'b0}}, 1'b1});
    end
    if (drain_end) begin
        draining_reg <= 1'b0;
    end
    if (drain_start) begin
        draining_reg <= 1'b1;
        rd_gi_reg <= {GW{1'b0}};
        rd_left_reg <= d_count;
        rd_end_reg <= (d_count == {GW{1'b0}});
        rd_half_reg <= d_half;
        rd_last_reg <= d_last;
        rd_bad_reg <= d_bad;
        rd_inv_reg <= d_inv;
    end
    if (rst || clear) begin
        draining_reg <= 1'b0;
        rd_gi_reg <= {GW{1'b0}};
    end
end

// the inverse scale and the flags of the group read now, for the clock its x is in x_reg,
// and the inverse scale again for x_mul_reg
reg [31:0] inv_reg, inv_mul_reg;
reg x_valid_reg, x_last_reg, x_bad_reg;
always @(posedge clk) begin
    inv_reg <= rd_inv_reg;
    inv_mul_reg <= inv_reg;
    x_valid_reg <= drain_read;
    x_last_reg <= drain_end && rd_last_reg;
    x_bad_reg <= rd_bad_reg;
    if (rst || clear) begin
        x_valid_reg <= 1'b0;
    end
end

wire y_valid, y_last, y_bad;
l2l_optim_delay #(.WIDTH(3), .DEPTH(1 + FP32_MUL_LATENCY), .RESET(1)) mul_side (
    .clk(clk), .rst(rst || clear),
    .x({x_valid_reg, x_last_reg, x_bad_reg}), .y({y_valid, y_last, y_bad})
);

// ---------------------------------------------------------------- encode
localparam [31:0] REBASE = (127 - BIAS) << 23;
localparam [31:0] SUB_LIMIT_32 = (128 - BIAS) << 23;
localparam [30:0] SUB_LIMIT = SUB_LIMIT_32[30:0];  // below: the subnormal grid
localparam integer SUB_R0 = 148 - BIAS - (127 - BIAS);  // the smallest right shift of the subnormal grid (21)
localparam integer SUB_R_BASE_I = 148 - BIAS;
localparam [8:0] SUB_R_BASE = SUB_R_BASE_I[8:0];
localparam [8:0] SUB_R0_9 = SUB_R0[8:0];
localparam [31-DROP:0] MAX_MAG_W = MAX_MAG[31-DROP:0];

genvar k;
generate
for (k = 0; k < LANES; k = k + 1) begin : g_lane
    wire [31:0] y;
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused_valid;
    wire [4:0] unused_flags;
    /* verilator lint_on UNUSEDSIGNAL */
    fp32_mul mul (.clk(clk), .rst(rst), .ce(1'b1), .in_valid(1'b1), .a(x_mul_reg[32*k +: 32]), .b(inv_mul_reg),
                  .y(y), .out_valid(unused_valid), .flags(unused_flags));

    wire [30:0] mag = y[30:0];
    // normal grid: rebase the exponent to the code's, round to nearest even at bit DROP
    /* verilator lint_off UNUSEDSIGNAL */
    wire [31:0] rebased = {1'b0, mag} - REBASE;
    wire [31:0] normal_rounded = rebased + ((32'd1 << (DROP - 1)) - 32'd1) + {31'd0, rebased[DROP]};
    /* verilator lint_on UNUSEDSIGNAL */
    wire [31-DROP:0] normal = normal_rounded[31:DROP];
    // subnormal grid: the significand times 2^(max(E, 1) - 150 + BIAS + 2), rounded to an
    // integer: a right shift by r = 148 - BIAS - max(E, 1) >= SUB_R0, nothing left above r = 25
    wire [7:0] e1 = (y[30:23] == 8'd0) ? 8'd1 : y[30:23];
    wire [23:0] sig = {y[30:23] != 8'd0, y[22:0]};
    wire [8:0] r = SUB_R_BASE - {1'b0, e1};
    wire [8:0] r_extra = r - SUB_R0_9;               // 0..4 matter, more leaves 0
    wire [23:0] sig_s = (r_extra > 9'd4) ? 24'd0 : sig >> r_extra[2:0];
    wire sticky0 = (r_extra > 9'd4) ? (sig != 0) : ((sig & ~(24'hFFFFFF << r_extra[2:0])) != 0);
    wire [3:0] sub_q = {1'b0, sig_s[23:SUB_R0]};
    wire sub_guard = sig_s[SUB_R0-1];
    wire sub_sticky = sticky0 || (sig_s[SUB_R0-2:0] != 0);
    wire [3:0] sub = sub_q + {3'd0, sub_guard && (sub_sticky || sub_q[0])};

    // stage 1: both grids, registered
    reg is_sub_reg, sign_reg, bad_reg;
    reg [31-DROP:0] normal_reg;
    reg [3:0] sub_reg;
    always @(posedge clk) begin
        is_sub_reg <= (mag < SUB_LIMIT);
        sign_reg <= y[31];
        normal_reg <= normal;
        sub_reg <= sub;
        bad_reg <= y_bad;
    end
    // stage 2: select, saturate, sign
    wire [31-DROP:0] c_mag = is_sub_reg ? {{(28-DROP){1'b0}}, sub_reg} : normal_reg;
    wire [7:0] c_sat = (c_mag > MAX_MAG_W) ? MAX_MAG_W[7:0] : c_mag[7:0];
    reg [7:0] code_reg;
    always @(posedge clk) begin
        code_reg <= bad_reg ? 8'd0 : (SIGNED ? {sign_reg, c_sat[6:0]} : c_sat);
    end
    assign out_code[8*k +: 8] = code_reg;
end
endgenerate

l2l_optim_delay #(.WIDTH(2), .DEPTH(QUANT_ENCODE_LATENCY), .RESET(1)) encode_side (
    .clk(clk), .rst(rst || clear), .x({y_valid, y_last}), .y({out_valid, out_last})
);

reg [15:0] held_reg;
always @(posedge clk) begin
    held_reg <= held_reg + {15'd0, in_valid} - {15'd0, out_valid};
    if (rst || clear) begin
        held_reg <= 16'd0;
    end
end
assign held = held_reg;

endmodule

`resetall
