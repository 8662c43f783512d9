// SPDX-License-Identifier: Apache-2.0
// IEEE-754 binary32 square root: y = sqrt(a).
//
// Round to nearest even; subnormal inputs exact (a square root is never
// subnormal, never overflows); sqrt(-0) = -0; every NaN result is the
// canonical quiet NaN 0x7FC00000; a signalling NaN or any value below zero
// (-Inf included) raises invalid.
//
// flags = {invalid, divide_by_zero, overflow, underflow, inexact} = [4:0]: the
// bit layout of Berkeley SoftFloat's softfloat_exceptionFlags (inexact = 1,
// underflow = 2, overflow = 4, infinite = 8, invalid = 16).
//
// Scheme: radix-2 restoring digit-by-digit square root, unrolled. The
// significand is normalized to [1, 2) and doubled for an odd exponent, so the
// radicand lies in [1, 4) and the root in [1, 2): 25 root bits (24 kept and a
// guard bit) plus the sticky bit "remainder != 0" give the exactly rounded
// result (a root is never a tie: the remainder decides). Each step is one
// 28-bit compare-subtract; STEPS_PER_STAGE steps share a pipeline stage.
//
// Fully pipelined: one operation per clock, LATENCY = FP32_SQRT_LATENCY cycles
// (hdl/fp/fp_latency.vh: 5 + ceil(25 / STEPS_PER_STAGE) + FP_ROUND_LATENCY)
// from an input accepted (in_valid with ce high) to out_valid. ce low holds
// every stage, out_valid included.
//   stage 1        classify, special results
//   stage 2        count leading zeros of a subnormal significand
//   stage 3        normalize it, halve the exponent
//   stages 4..     SQRT_STAGES stages of STEPS_PER_STAGE restoring steps
//   sticky         remainder != 0
//   stages         round and pack (fp_round_pack, FP_ROUND_LATENCY stages)
//   last           special results, output register

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp32_sqrt
(
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,

    input  wire        in_valid,
    input  wire [31:0] a,

    output wire        out_valid,
    output wire [31:0] y,
    output wire [4:0]  flags
);

`include "fp_latency.vh"
// Restoring steps per pipeline stage (one 28-bit carry chain each).
localparam STEPS_PER_STAGE = FP32_SQRT_STEPS_PER_STAGE;
localparam ROOT_W = 25;   // root bits: integer bit, 23 mantissa bits, guard
localparam REM_W  = 28;   // remainder r <= 2 * root < 2^26, shifted by 2 plus 2 bits
localparam RAD_W  = 2 * ROOT_W;  // radicand integer M * 2^25, consumed 2 bits a step
localparam SQRT_STAGES = (ROOT_W + STEPS_PER_STAGE - 1) / STEPS_PER_STAGE;
// Cycles from input to output (hdl/fp/fp_latency.vh); the bench reads and checks it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = FP32_SQRT_LATENCY;
/* verilator lint_on UNUSEDPARAM */
localparam [31:0] QNAN = 32'h7FC00000;
localparam BIAS = 127;

// ---------------------------------------------------------------- stage 1
wire        a_sign;
wire [7:0]  a_exp;
wire [23:0] a_sig;
wire a_zero, a_inf, a_nan, a_snan;

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_a (
    .x(a), .sign(a_sign), .exp_eff(a_exp), .sig(a_sig),
    .is_zero(a_zero), .is_inf(a_inf), .is_nan(a_nan), .is_snan(a_snan)
);

wire negative = a_sign && !a_zero && !a_nan;
wire special = a_nan || a_inf || a_zero || negative;
// +-0 and +Inf are their own roots.
wire [31:0] special_y = (a_nan || negative) ? QNAN : a;
wire [4:0] special_flags = {a_snan || negative, 4'b0000};

reg        s1_valid;
reg        s1_special;
reg [31:0] s1_special_y;
reg [4:0]  s1_special_flags;
reg [7:0]  s1_exp;
reg [23:0] s1_sig;

always @(posedge clk) begin
    if (ce) begin
        s1_valid         <= in_valid;
        s1_special       <= special;
        s1_special_y     <= special_y;
        s1_special_flags <= special_flags;
        s1_exp           <= a_exp;
        s1_sig           <= a_sig;
    end
    if (rst) begin
        s1_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 2
wire [4:0] sig_lz;

fp_lzc #(.WIDTH(24), .COUNT_W(5)) lzc_a (.in(s1_sig), .count(sig_lz));

// Side band that travels alongside the datapath: special, y, flags.
localparam SIDE_W = 1 + 32 + 5;

reg              s2_valid;
reg [SIDE_W-1:0] s2_side;
reg [7:0]        s2_exp;
reg [23:0]       s2_sig;
reg [4:0]        s2_lz;

always @(posedge clk) begin
    if (ce) begin
        s2_valid <= s1_valid;
        s2_side  <= {s1_special, s1_special_y, s1_special_flags};
        s2_exp   <= s1_exp;
        s2_sig   <= s1_sig;
        s2_lz    <= sig_lz;
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 3
// a = (n / 2^23) * 2^e with n in [2^23, 2^24) and e unbiased. An odd e moves
// one factor 2 into the radicand so the root exponent is e / 2 exactly.
wire [23:0]       norm_sig = s2_sig << s2_lz;
wire signed [9:0] unb_exp  = $signed({2'b00, s2_exp}) - $signed({5'b00000, s2_lz}) - BIAS;
wire              exp_odd  = unb_exp[0];
wire [24:0]       radicand = exp_odd ? {norm_sig, 1'b0} : {1'b0, norm_sig};
wire signed [9:0] root_exp = (unb_exp >>> 1) + BIAS;

reg              s3_valid;
reg [SIDE_W+9:0] s3_side;   // {side, root exponent}
reg [RAD_W-1:0]  s3_rad;

always @(posedge clk) begin
    if (ce) begin
        s3_valid <= s2_valid;
        s3_side  <= {s2_side, root_exp};
        // root = floor(sqrt(radicand * 2^25)) has ROOT_W bits
        s3_rad   <= {radicand, {(RAD_W-25){1'b0}}};
    end
    if (rst) begin
        s3_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- recurrence
wire [(SQRT_STAGES+1)*REM_W-1:0]  rem_chain;
wire [(SQRT_STAGES+1)*ROOT_W-1:0] root_chain;
// The radicand copy after the last stage is unused; synthesis drops it.
/* verilator lint_off UNUSEDSIGNAL */
wire [(SQRT_STAGES+1)*RAD_W-1:0]  rad_chain;
/* verilator lint_on UNUSEDSIGNAL */

assign rem_chain[REM_W-1:0]   = {REM_W{1'b0}};
assign root_chain[ROOT_W-1:0] = {ROOT_W{1'b0}};
assign rad_chain[RAD_W-1:0]   = s3_rad;

genvar k;
generate
    for (k = 0; k < SQRT_STAGES; k = k + 1) begin : sqrt_stage
        wire [REM_W-1:0]  rem_in  = rem_chain[k*REM_W +: REM_W];
        wire [ROOT_W-1:0] root_in = root_chain[k*ROOT_W +: ROOT_W];
        wire [RAD_W-1:0]  rad_in  = rad_chain[k*RAD_W +: RAD_W];

        reg [REM_W-1:0]  rem_next;
        reg [ROOT_W-1:0] root_next;
        reg [RAD_W-1:0]  rad_next;
        reg [REM_W-1:0]  trial;
        reg [REM_W:0]    diff;
        integer j;

        // One restoring step: bring down two radicand bits, r = 4r + bits;
        // trial = 4q + 1; if r >= trial the next root bit is 1 and r -= trial.
        always @* begin
            rem_next  = rem_in;
            root_next = root_in;
            rad_next  = rad_in;
            trial     = {REM_W{1'b0}};
            diff      = {(REM_W+1){1'b0}};
            for (j = 0; j < STEPS_PER_STAGE; j = j + 1) begin
                if (k * STEPS_PER_STAGE + j < ROOT_W) begin
                    rem_next = {rem_next[REM_W-3:0], rad_next[RAD_W-1 -: 2]};
                    rad_next = rad_next << 2;
                    trial    = {{(REM_W-ROOT_W-2){1'b0}}, root_next, 2'b01};
                    // one carry chain: its borrow out is the compare
                    diff     = {1'b0, rem_next} - {1'b0, trial};
                    if (!diff[REM_W]) begin
                        rem_next  = diff[REM_W-1:0];
                        root_next = {root_next[ROOT_W-2:0], 1'b1};
                    end else begin
                        root_next = {root_next[ROOT_W-2:0], 1'b0};
                    end
                end
            end
        end

        reg [REM_W-1:0]  rem_reg;
        reg [ROOT_W-1:0] root_reg;
        reg [RAD_W-1:0]  rad_reg;

        always @(posedge clk) begin
            if (ce) begin
                rem_reg  <= rem_next;
                root_reg <= root_next;
                rad_reg  <= rad_next;
            end
        end

        assign rem_chain[(k+1)*REM_W +: REM_W]    = rem_reg;
        assign root_chain[(k+1)*ROOT_W +: ROOT_W] = root_reg;
        assign rad_chain[(k+1)*RAD_W +: RAD_W]    = rad_reg;
    end
endgenerate

wire              rec_valid;
wire [SIDE_W+9:0] rec_side;

fp_pipe #(.WIDTH(SIDE_W+10), .DEPTH(SQRT_STAGES)) side_pipe (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(s3_valid), .in_data(s3_side),
    .out_valid(rec_valid), .out_data(rec_side)
);

// ---------------------------------------------------------------- sticky
wire [REM_W-1:0]  rem_final  = rem_chain[SQRT_STAGES*REM_W +: REM_W];
wire [ROOT_W-1:0] root_final = root_chain[SQRT_STAGES*ROOT_W +: ROOT_W];

reg              st_valid;
reg [SIDE_W+9:0] st_side;
reg [ROOT_W-1:0] st_root;
reg              st_sticky;

always @(posedge clk) begin
    if (ce) begin
        st_valid  <= rec_valid;
        st_side   <= rec_side;
        st_root   <= root_final;
        st_sticky <= |rem_final;
    end
    if (rst) begin
        st_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- round
wire              rounded_valid;
wire [SIDE_W-1:0] rounded_side;
wire [31:0]       rounded_y;
wire rounded_inexact;
// A root of a binary32 value is always normal: no overflow or underflow.
/* verilator lint_off UNUSEDSIGNAL */
wire rounded_overflow, rounded_underflow;
/* verilator lint_on UNUSEDSIGNAL */

fp_round_pack #(.EXP_W(8), .MAN_W(23), .SIG_W(ROOT_W+1), .E_W(10), .SIDE_W(SIDE_W)) round_root (
    .clk(clk), .rst(rst), .ce(ce), .in_valid(st_valid), .in_side(st_side[SIDE_W+9:10]),
    .sign(1'b0), .exp(st_side[9:0]), .sig({st_root, 1'b0}), .sticky(st_sticky),
    .out_valid(rounded_valid), .out_side(rounded_side),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// ---------------------------------------------------------------- last stage
wire        r_special       = rounded_side[SIDE_W-1];
wire [31:0] r_special_y     = rounded_side[SIDE_W-2 -: 32];
wire [4:0]  r_special_flags = rounded_side[4:0];

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [32-1:0] result_y;
wire [4:0] result_flags;
assign result_y     = r_special ? r_special_y : rounded_y;
assign result_flags = r_special ? r_special_flags : {4'b0000, rounded_inexact};

fp_pipe #(.WIDTH(32+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(rounded_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
