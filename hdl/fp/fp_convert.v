// SPDX-License-Identifier: Apache-2.0
// Convert between IEEE-754 formats (binary32, bfloat16, binary16): the shared
// body of fp32_to_bf16, fp32_to_fp16, bf16_to_fp32 and fp16_to_fp32.
//
// Round to nearest even (narrowing); subnormal inputs and outputs exact (no
// flush to zero); a NaN gives the canonical quiet NaN of the output format
// (sign 0, exponent all ones, top mantissa bit set: 0x7FC00000, 0x7FC0,
// 0x7E00); a signalling NaN raises invalid. Widening conversions are exact
// and raise nothing else. Tininess is detected after rounding.
//
// flags = {invalid, divide_by_zero, overflow, underflow, inexact} = [4:0]: the
// bit layout of Berkeley SoftFloat's softfloat_exceptionFlags.
//
// Fully pipelined: LATENCY = FP_CONVERT_LATENCY (hdl/fp/fp_latency.vh). ce
// low holds every stage, out_valid included.
//   stage 1  classify, special results, count leading zeros
//   stage 2  normalize, rebias the exponent
//   stages   round and pack (fp_round_pack, FP_ROUND_LATENCY stages)
//   last     special results, output register

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp_convert #
(
    parameter IN_EXP_W  = 8,
    parameter IN_MAN_W  = 23,
    parameter OUT_EXP_W = 8,
    parameter OUT_MAN_W = 7
)
(
    input  wire                         clk,
    input  wire                         rst,
    input  wire                         ce,

    input  wire                         in_valid,
    input  wire [IN_EXP_W+IN_MAN_W:0]   a,

    output wire                         out_valid,
    output wire [OUT_EXP_W+OUT_MAN_W:0] y,
    output wire [4:0]                   flags
);

localparam OUT_W   = 1 + OUT_EXP_W + OUT_MAN_W;
localparam IN_BIAS  = (1 << (IN_EXP_W - 1)) - 1;
localparam OUT_BIAS = (1 << (OUT_EXP_W - 1)) - 1;
localparam SIG_IN_W = IN_MAN_W + 1;
// fp_round_pack needs hidden bit + mantissa + 2 bits below.
localparam SIG_W = (SIG_IN_W > OUT_MAN_W + 3) ? SIG_IN_W : OUT_MAN_W + 3;
localparam E_W   = ((IN_EXP_W > OUT_EXP_W) ? IN_EXP_W : OUT_EXP_W) + 3;
localparam LZ_W  = $clog2(SIG_IN_W + 1);
localparam [OUT_W-1:0] QNAN = {1'b0, {OUT_EXP_W{1'b1}}, 1'b1, {(OUT_MAN_W-1){1'b0}}};

// ---------------------------------------------------------------- stage 1
wire                a_sign;
wire [IN_EXP_W-1:0] a_exp;
wire [IN_MAN_W:0]   a_sig;
wire a_zero, a_inf, a_nan, a_snan;

fp_classify #(.EXP_W(IN_EXP_W), .MAN_W(IN_MAN_W)) classify_a (
    .x(a), .sign(a_sign), .exp_eff(a_exp), .sig(a_sig),
    .is_zero(a_zero), .is_inf(a_inf), .is_nan(a_nan), .is_snan(a_snan)
);

wire special = a_nan || a_inf || a_zero;
wire [OUT_W-1:0] special_y = a_nan ? QNAN :
                             a_inf ? {a_sign, {OUT_EXP_W{1'b1}}, {OUT_MAN_W{1'b0}}}
                                   : {a_sign, {(OUT_W-1){1'b0}}};

wire [LZ_W-1:0] sig_lz;

fp_lzc #(.WIDTH(SIG_IN_W), .COUNT_W(LZ_W)) lzc_a (.in(a_sig), .count(sig_lz));

// Side band of the datapath: special, special_y, special_invalid, sign.
localparam SIDE_W = 1 + OUT_W + 1 + 1;

reg                s1_valid;
reg [SIDE_W-1:0]   s1_side;
reg [IN_EXP_W-1:0] s1_exp;
reg [IN_MAN_W:0]   s1_sig;
reg [LZ_W-1:0]     s1_lz;

always @(posedge clk) begin
    if (ce) begin
        s1_valid <= in_valid;
        s1_side  <= {special, special_y, a_snan, a_sign};
        s1_exp   <= a_exp;
        s1_sig   <= a_sig;
        s1_lz    <= sig_lz;
    end
    if (rst) begin
        s1_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 2
// Same value, exponent of the leading one in the output's bias.
wire signed [E_W-1:0] out_exp = $signed({{(E_W-IN_EXP_W){1'b0}}, s1_exp})
                              - $signed({{(E_W-LZ_W){1'b0}}, s1_lz})
                              - IN_BIAS + OUT_BIAS;

reg                   s2_valid;
reg [SIDE_W-1:0]      s2_side;
reg signed [E_W-1:0]  s2_exp;
reg [SIG_W-1:0]       s2_sig;

always @(posedge clk) begin
    if (ce) begin
        s2_valid <= s1_valid;
        s2_side  <= s1_side;
        s2_exp   <= out_exp;
        s2_sig   <= {s1_sig << s1_lz, {(SIG_W-SIG_IN_W){1'b0}}};
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- round
wire              rounded_valid;
wire [SIDE_W-1:0] rounded_side;
wire [OUT_W-1:0]  rounded_y;
wire rounded_overflow, rounded_underflow, rounded_inexact;

fp_round_pack #(.EXP_W(OUT_EXP_W), .MAN_W(OUT_MAN_W), .SIG_W(SIG_W), .E_W(E_W), .SIDE_W(SIDE_W)) round_out (
    .clk(clk), .rst(rst), .ce(ce), .in_valid(s2_valid), .in_side(s2_side),
    .sign(s2_side[0]), .exp(s2_exp), .sig(s2_sig), .sticky(1'b0),
    .out_valid(rounded_valid), .out_side(rounded_side),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// ---------------------------------------------------------------- last stage
wire             r_special         = rounded_side[SIDE_W-1];
wire [OUT_W-1:0] r_special_y       = rounded_side[SIDE_W-2 -: OUT_W];
wire             r_special_invalid = rounded_side[1];

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [OUT_W-1:0] result_y;
wire [4:0] result_flags;
assign result_y     = r_special ? r_special_y : rounded_y;
assign result_flags = r_special ? {r_special_invalid, 4'b0000} : {2'b00, rounded_overflow, rounded_underflow, rounded_inexact};

fp_pipe #(.WIDTH(OUT_W+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(rounded_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
