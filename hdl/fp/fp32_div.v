// SPDX-License-Identifier: Apache-2.0
// IEEE-754 binary32 divider: y = a / b.
//
// Round to nearest even; subnormal inputs and outputs exact (no flush to
// zero); every NaN result is the canonical quiet NaN 0x7FC00000; a signalling
// NaN operand raises invalid, as do 0/0 and Inf/Inf; finite nonzero / 0 gives
// a signed infinity and raises divide_by_zero.
//
// flags = {invalid, divide_by_zero, overflow, underflow, inexact} = [4:0]: the
// bit layout of Berkeley SoftFloat's softfloat_exceptionFlags (inexact = 1,
// underflow = 2, overflow = 4, infinite = 8, invalid = 16). Tininess is
// detected after rounding.
//
// Scheme: radix-2 restoring division, unrolled. Both significands are
// normalized to [1, 2) first, so the quotient lies in (1/2, 2): 26 quotient
// bits (the integer bit, 23 mantissa bits, guard, and one spare for the
// quotient < 1 case) plus the sticky bit "remainder != 0" give the exactly
// rounded result. Each step is one 25-bit compare-subtract; STEPS_PER_STAGE
// steps share a pipeline stage.
//
// Fully pipelined: one operation per clock, LATENCY = FP32_DIV_LATENCY cycles
// (hdl/fp/fp_latency.vh: 5 + ceil(26 / STEPS_PER_STAGE) + FP_ROUND_LATENCY)
// from an input accepted (in_valid with ce high) to out_valid. ce low holds
// every stage, out_valid included.
//   stage 1        classify
//   stage 2        special results from the classes; count leading zeros
//                  of subnormal significands
//   stage 3        normalize them, quotient exponent
//   stages 4..     DIV_STAGES stages of STEPS_PER_STAGE restoring steps
//   select         quotient alignment (below or above 1), sticky bit
//   stages         round and pack (fp_round_pack, FP_ROUND_LATENCY stages)
//   last           special results, output register

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp32_div
(
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,

    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,

    output wire        out_valid,
    output wire [31:0] y,
    output wire [4:0]  flags
);

`include "fp_latency.vh"
// Restoring steps per pipeline stage: more steps, fewer registers and cycles but a
// longer combinational path (one carry chain each).
localparam STEPS_PER_STAGE = FP32_DIV_STEPS_PER_STAGE;
localparam QUO_W = 26;  // quotient bits computed
localparam REM_W = 25;  // partial remainder r < 2 * divisor < 2^25
localparam DIV_STAGES = (QUO_W + STEPS_PER_STAGE - 1) / STEPS_PER_STAGE;
// Cycles from input to output (hdl/fp/fp_latency.vh); the bench reads and checks it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = FP32_DIV_LATENCY;
/* verilator lint_on UNUSEDPARAM */
localparam [31:0] QNAN = 32'h7FC00000;
localparam BIAS = 127;

// ---------------------------------------------------------------- stage 1
wire        a_sign, b_sign;
wire [7:0]  a_exp, b_exp;
wire [23:0] a_sig, b_sig;
wire a_zero, a_inf, a_nan, a_snan;
wire b_zero, b_inf, b_nan, b_snan;

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_a (
    .x(a), .sign(a_sign), .exp_eff(a_exp), .sig(a_sig),
    .is_zero(a_zero), .is_inf(a_inf), .is_nan(a_nan), .is_snan(a_snan)
);

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_b (
    .x(b), .sign(b_sign), .exp_eff(b_exp), .sig(b_sig),
    .is_zero(b_zero), .is_inf(b_inf), .is_nan(b_nan), .is_snan(b_snan)
);

wire sign = a_sign ^ b_sign;

// the operands' classes, registered: the special results follow from them in stage 2
// (timing: classify and the special-case decision did not fit one clock after the operand's
// route in the lane)
reg        s1_valid;
reg        s1_a_nan, s1_a_inf, s1_a_zero, s1_a_snan;
reg        s1_b_nan, s1_b_inf, s1_b_zero, s1_b_snan;
reg        s1_sign;
reg [7:0]  s1_a_exp, s1_b_exp;
reg [23:0] s1_a_sig, s1_b_sig;

always @(posedge clk) begin
    if (ce) begin
        s1_valid         <= in_valid;
        s1_a_nan         <= a_nan;
        s1_a_inf         <= a_inf;
        s1_a_zero        <= a_zero;
        s1_a_snan        <= a_snan;
        s1_b_nan         <= b_nan;
        s1_b_inf         <= b_inf;
        s1_b_zero        <= b_zero;
        s1_b_snan        <= b_snan;
        s1_sign          <= sign;
        s1_a_exp         <= a_exp;
        s1_b_exp         <= b_exp;
        s1_a_sig         <= a_sig;
        s1_b_sig         <= b_sig;
    end
    if (rst) begin
        s1_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 2
wire [4:0] a_lz, b_lz;

fp_lzc #(.WIDTH(24), .COUNT_W(5)) lzc_a (.in(s1_a_sig), .count(a_lz));
fp_lzc #(.WIDTH(24), .COUNT_W(5)) lzc_b (.in(s1_b_sig), .count(b_lz));

// Side band that travels alongside the datapath: special, y, flags, sign.
localparam SIDE_W = 1 + 32 + 5 + 1;
wire invalid_op = (s1_a_zero && s1_b_zero) || (s1_a_inf && s1_b_inf);
wire div_by_zero = s1_b_zero && !s1_a_zero && !s1_a_inf && !s1_a_nan;
wire special = s1_a_nan || s1_b_nan || s1_a_inf || s1_b_inf || s1_a_zero || s1_b_zero;
wire [31:0] special_y = (s1_a_nan || s1_b_nan || invalid_op) ? QNAN :
                        (s1_a_inf || s1_b_zero) ? {s1_sign, 8'hFF, 23'd0} : {s1_sign, 31'd0};
wire [4:0] special_flags = {s1_a_snan || s1_b_snan || invalid_op, div_by_zero, 3'b000};

reg              s2_valid;
reg [SIDE_W-1:0] s2_side;
reg [7:0]        s2_a_exp, s2_b_exp;
reg [23:0]       s2_a_sig, s2_b_sig;
reg [4:0]        s2_a_lz, s2_b_lz;

always @(posedge clk) begin
    if (ce) begin
        s2_valid <= s1_valid;
        s2_side  <= {special, special_y, special_flags, s1_sign};
        s2_a_exp <= s1_a_exp;
        s2_b_exp <= s1_b_exp;
        s2_a_sig <= s1_a_sig;
        s2_b_sig <= s1_b_sig;
        s2_a_lz  <= a_lz;
        s2_b_lz  <= b_lz;
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 3
// a / b = (na / nb) * 2^(exp - BIAS) with na, nb in [2^23, 2^24).
wire signed [9:0] quo_exp = $signed({2'b00, s2_a_exp}) - $signed({5'b00000, s2_a_lz})
                          - $signed({2'b00, s2_b_exp}) + $signed({5'b00000, s2_b_lz}) + BIAS;

reg                 s3_valid;
reg [SIDE_W+9:0]    s3_side;   // {side, quotient exponent}
reg [23:0]          s3_dividend;
reg [23:0]          s3_divisor;

always @(posedge clk) begin
    if (ce) begin
        s3_valid    <= s2_valid;
        s3_side     <= {s2_side, quo_exp};
        s3_dividend <= s2_a_sig << s2_a_lz;
        s3_divisor  <= s2_b_sig << s2_b_lz;
    end
    if (rst) begin
        s3_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- recurrence
// Stage k reads slice k of each chain and writes slice k+1.
wire [(DIV_STAGES+1)*REM_W-1:0] rem_chain;
wire [(DIV_STAGES+1)*QUO_W-1:0] quo_chain;
// The divisor copy after the last stage is unused; synthesis drops it.
/* verilator lint_off UNUSEDSIGNAL */
wire [(DIV_STAGES+1)*24-1:0]    dvs_chain;
/* verilator lint_on UNUSEDSIGNAL */

assign rem_chain[REM_W-1:0] = {1'b0, s3_dividend};
assign quo_chain[QUO_W-1:0] = {QUO_W{1'b0}};
assign dvs_chain[23:0]      = s3_divisor;

genvar k;
generate
    for (k = 0; k < DIV_STAGES; k = k + 1) begin : div_stage
        wire [REM_W-1:0] rem_in = rem_chain[k*REM_W +: REM_W];
        wire [QUO_W-1:0] quo_in = quo_chain[k*QUO_W +: QUO_W];
        wire [23:0]      dvs_in = dvs_chain[k*24 +: 24];

        reg [REM_W-1:0] rem_next;
        reg [QUO_W-1:0] quo_next;
        integer j;

        reg [REM_W:0]   diff;

        // One restoring step: quotient bit = (r >= d); r = 2 * (r - bit * d).
        // One carry chain per step: the borrow out of r - d is the compare.
        always @* begin
            rem_next = rem_in;
            quo_next = quo_in;
            diff     = {(REM_W+1){1'b0}};
            for (j = 0; j < STEPS_PER_STAGE; j = j + 1) begin
                if (k * STEPS_PER_STAGE + j < QUO_W) begin
                    diff = {1'b0, rem_next} - {2'b00, dvs_in};
                    if (!diff[REM_W]) begin
                        rem_next = diff[REM_W-1:0] << 1;
                        quo_next = {quo_next[QUO_W-2:0], 1'b1};
                    end else begin
                        rem_next = rem_next << 1;
                        quo_next = {quo_next[QUO_W-2:0], 1'b0};
                    end
                end
            end
        end

        reg [REM_W-1:0] rem_reg;
        reg [QUO_W-1:0] quo_reg;
        reg [23:0]      dvs_reg;

        always @(posedge clk) begin
            if (ce) begin
                rem_reg <= rem_next;
                quo_reg <= quo_next;
                dvs_reg <= dvs_in;
            end
        end

        assign rem_chain[(k+1)*REM_W +: REM_W] = rem_reg;
        assign quo_chain[(k+1)*QUO_W +: QUO_W] = quo_reg;
        assign dvs_chain[(k+1)*24 +: 24]       = dvs_reg;
    end
endgenerate

wire              rec_valid;
wire [SIDE_W+9:0] rec_side;

fp_pipe #(.WIDTH(SIDE_W+10), .DEPTH(DIV_STAGES)) side_pipe (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(s3_valid), .in_data(s3_side),
    .out_valid(rec_valid), .out_data(rec_side)
);

// ---------------------------------------------------------------- select
wire signed [9:0] rec_exp    = rec_side[9:0];
wire [REM_W-1:0]  rem_final  = rem_chain[DIV_STAGES*REM_W +: REM_W];
wire [QUO_W-1:0]  quo_final  = quo_chain[DIV_STAGES*QUO_W +: QUO_W];

// Quotient >= 1 has its leading one at bit 25; otherwise at bit 24, one
// binade lower.
wire quo_high = quo_final[QUO_W-1];

reg              sel_valid;
reg [SIDE_W-1:0] sel_side;
reg signed [9:0] sel_exp;
reg [QUO_W-1:0]  sel_sig;
reg              sel_sticky;

always @(posedge clk) begin
    if (ce) begin
        sel_valid  <= rec_valid;
        sel_side   <= rec_side[SIDE_W+9:10];
        sel_exp    <= quo_high ? rec_exp : rec_exp - 10'sd1;
        sel_sig    <= quo_high ? quo_final : {quo_final[QUO_W-2:0], 1'b0};
        sel_sticky <= |rem_final;
    end
    if (rst) begin
        sel_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- round
wire              rounded_valid;
wire [SIDE_W-1:0] rounded_side;
wire [31:0]       rounded_y;
wire rounded_overflow, rounded_underflow, rounded_inexact;

fp_round_pack #(.EXP_W(8), .MAN_W(23), .SIG_W(QUO_W), .E_W(10), .SIDE_W(SIDE_W)) round_quo (
    .clk(clk), .rst(rst), .ce(ce), .in_valid(sel_valid), .in_side(sel_side),
    .sign(sel_side[0]), .exp(sel_exp), .sig(sel_sig), .sticky(sel_sticky),
    .out_valid(rounded_valid), .out_side(rounded_side),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// ---------------------------------------------------------------- last stage
wire        r_special       = rounded_side[SIDE_W-1];
wire [31:0] r_special_y     = rounded_side[SIDE_W-2 -: 32];
wire [4:0]  r_special_flags = rounded_side[5:1];

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [32-1:0] result_y;
wire [4:0] result_flags;
assign result_y     = r_special ? r_special_y : rounded_y;
assign result_flags = r_special ? r_special_flags : {2'b00, rounded_overflow, rounded_underflow, rounded_inexact};

fp_pipe #(.WIDTH(32+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(rounded_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
