// SPDX-License-Identifier: Apache-2.0
// AXI4-Lite control slave of l2l_optim: the Vitis HLS ap_ctrl_hs register
// map, the kernel's arguments and its read-only status.
//
// Offsets and fields come from l2l_optim_regs.vh, generated from
// hdl/l2l_optim_regs.json (the one source). Behaviour of the HLS block:
//   CTRL  bit 0 ap_start: write 1 sets it; it clears at ap_ready unless
//         auto_restart (bit 7) is set. bit 1 ap_done and bit 3 ap_ready are
//         set by the kernel and cleared when CTRL is read. bit 2 ap_idle.
//   GIE   bit 0; IER bits 0 (done), 1 (ready); ISR the same bits, set by the
//         events enabled in IER, toggled by writing 1 (toggle-on-write).
//   interrupt = GIE & |ISR.
// Arguments are plain registers; the kernel latches what it needs at
// ap_start, so do not write them while a run is in progress. Write strobes
// are honoured per byte.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_ctrl #
(
    parameter ADDR_WIDTH = 8,
    parameter DATA_BYTES = 8
)
(
    input  wire                   clk,
    input  wire                   rst,

    /*
     * AXI4-Lite slave
     */
    input  wire [ADDR_WIDTH-1:0]  s_axil_awaddr,
    input  wire [2:0]             s_axil_awprot,
    input  wire                   s_axil_awvalid,
    output wire                   s_axil_awready,
    input  wire [31:0]            s_axil_wdata,
    input  wire [3:0]             s_axil_wstrb,
    input  wire                   s_axil_wvalid,
    output wire                   s_axil_wready,
    output wire [1:0]             s_axil_bresp,
    output wire                   s_axil_bvalid,
    input  wire                   s_axil_bready,
    input  wire [ADDR_WIDTH-1:0]  s_axil_araddr,
    input  wire [2:0]             s_axil_arprot,
    input  wire                   s_axil_arvalid,
    output wire                   s_axil_arready,
    output wire [31:0]            s_axil_rdata,
    output wire [1:0]             s_axil_rresp,
    output wire                   s_axil_rvalid,
    input  wire                   s_axil_rready,

    output wire                   interrupt,

    /*
     * Kernel handshake (ap_ctrl_hs)
     */
    output wire                   ap_start,
    input  wire                   ap_idle,
    input  wire                   ap_done,    // one-clock pulse
    input  wire                   ap_ready,   // one-clock pulse

    /*
     * Arguments
     */
    output wire [64*8-1:0]        pointers,   // PARAM_SRC, M_SRC, V_SRC, GRAD_SRC, PARAM_DST, M_DST, V_DST, COPY_DST
    output wire [64*4-1:0]        scale_pointers,  // M_SCALE_SRC, V_SCALE_SRC, M_SCALE_DST, V_SCALE_DST
    output wire [31:0]            n,
    output wire [31:0]            mode,
    output wire [32*13-1:0]       scalars,    // INV_SCALE .. DAMPENING_COMPLEMENT in register order

    /*
     * Status
     */
    input  wire [31:0]            status,
    input  wire [63:0]            cycles
);

`include "l2l_optim_regs.vh"

localparam ARG_FIRST = REG_PARAM_SRC_LO;   // first argument word
localparam ARG_WORDS = (REG_DAMPENING_COMPLEMENT - REG_PARAM_SRC_LO) / 4 + 1;
// the scale pointers of the 8-bit state (register map version 2) sit after CYCLES
localparam ARG2_FIRST = REG_M_SCALE_SRC_LO;
localparam ARG2_WORDS = (REG_V_SCALE_DST_HI - REG_M_SCALE_SRC_LO) / 4 + 1;

reg ap_start_reg, ap_done_reg, ap_ready_reg, auto_restart_reg;
reg gie_reg;
reg [1:0] ier_reg, isr_reg;
reg [31:0] arg_reg [0:ARG_WORDS-1];
reg [31:0] arg2_reg [0:ARG2_WORDS-1];

reg awready_reg, bvalid_reg, arready_reg, rvalid_reg;
reg [31:0] rdata_reg;
// A read takes three clocks (AXI4-Lite allows any latency): the address into a register, then
// the select within each group of eight words, then the select among the groups (timing: one
// select over every register did not fit one clock, nor did it from a registered address).
localparam WORDS = 2**(ADDR_WIDTH-2);
localparam GROUPS = WORDS / 8;
reg read_reg;                     // the address is registered
reg [ADDR_WIDTH-1:0] raddr_reg;
reg group_read_reg;               // each group's word is registered
reg [31:0] group_word_reg [0:GROUPS-1];
reg [ADDR_WIDTH-6:0] group_reg;   // the group of the word read

assign s_axil_awready = awready_reg;
assign s_axil_wready = awready_reg;
assign s_axil_bresp = 2'b00;
assign s_axil_bvalid = bvalid_reg;
assign s_axil_arready = arready_reg;
assign s_axil_rdata = rdata_reg;
assign s_axil_rresp = 2'b00;
assign s_axil_rvalid = rvalid_reg;

assign interrupt = gie_reg && (isr_reg != 2'd0);
assign ap_start = ap_start_reg;

genvar k;
generate
for (k = 0; k < 8; k = k + 1) begin : g_ptr
    assign pointers[64*k +: 64] = {arg_reg[2*k+1], arg_reg[2*k]};
end
for (k = 0; k < 4; k = k + 1) begin : g_scale_ptr
    assign scale_pointers[64*k +: 64] = {arg2_reg[2*k+1], arg2_reg[2*k]};
end
for (k = 0; k < 13; k = k + 1) begin : g_scalar
    assign scalars[32*k +: 32] = arg_reg[(REG_INV_SCALE - ARG_FIRST) / 4 + k];
end
endgenerate
assign n = arg_reg[(REG_N - ARG_FIRST) / 4];
assign mode = arg_reg[(REG_MODE - ARG_FIRST) / 4];

/* verilator lint_off UNUSEDSIGNAL */
wire [2:0] unused_prot = s_axil_awprot ^ s_axil_arprot;
/* verilator lint_on UNUSEDSIGNAL */

wire do_write = s_axil_awvalid && s_axil_wvalid && !awready_reg && !bvalid_reg;
wire do_read = s_axil_arvalid && !arready_reg && !read_reg && !group_read_reg && !rvalid_reg;
/* verilator lint_off UNUSEDSIGNAL */
wire [1:0] unused_addr_lsb = s_axil_awaddr[1:0] ^ s_axil_araddr[1:0];
/* verilator lint_on UNUSEDSIGNAL */
wire [ADDR_WIDTH-1:0] waddr = {s_axil_awaddr[ADDR_WIDTH-1:2], 2'b00};
wire [ADDR_WIDTH-1:0] raddr = {s_axil_araddr[ADDR_WIDTH-1:2], 2'b00};

wire [31:0] ctrl_word = {24'd0, auto_restart_reg, 3'd0, ap_ready_reg, ap_idle, ap_done_reg, ap_start_reg};

// the readable words by word index (0 where nothing is mapped)
wire [31:0] read_word [0:WORDS-1];
generate
for (k = 0; k < WORDS; k = k + 1) begin : g_read_word
    if (4*k == REG_CTRL) begin : g_ctrl
        assign read_word[k] = ctrl_word;
    end else if (4*k == REG_GIE) begin : g_gie
        assign read_word[k] = {31'd0, gie_reg};
    end else if (4*k == REG_IER) begin : g_ier
        assign read_word[k] = {30'd0, ier_reg};
    end else if (4*k == REG_ISR) begin : g_isr
        assign read_word[k] = {30'd0, isr_reg};
    end else if (4*k == REG_ID) begin : g_id
        assign read_word[k] = REG_ID_VALUE;
    end else if (4*k == REG_VERSION) begin : g_version
        assign read_word[k] = REG_VERSION_VALUE;
    end else if (4*k == REG_STATUS) begin : g_status
        assign read_word[k] = status;
    end else if (4*k == REG_DATA_BYTES) begin : g_data_bytes
        assign read_word[k] = DATA_BYTES;
    end else if (4*k == REG_CYCLES_LO) begin : g_cycles_lo
        assign read_word[k] = cycles[31:0];
    end else if (4*k == REG_CYCLES_HI) begin : g_cycles_hi
        assign read_word[k] = cycles[63:32];
    end else if (4*k >= ARG_FIRST && 4*k < ARG_FIRST + 4*ARG_WORDS) begin : g_arg
        assign read_word[k] = arg_reg[k - ARG_FIRST/4];
    end else if (4*k >= ARG2_FIRST && 4*k < ARG2_FIRST + 4*ARG2_WORDS) begin : g_arg2
        assign read_word[k] = arg2_reg[k - ARG2_FIRST/4];
    end else begin : g_none
        assign read_word[k] = 32'd0;
    end
end
endgenerate

function [31:0] apply_strb(input [31:0] old, input [31:0] data, input [3:0] strb);
    integer b;
    begin
        for (b = 0; b < 4; b = b + 1) begin
            apply_strb[8*b +: 8] = strb[b] ? data[8*b +: 8] : old[8*b +: 8];
        end
    end
endfunction

integer i;

always @(posedge clk) begin
    awready_reg <= 1'b0;
    arready_reg <= 1'b0;

    if (s_axil_bready) begin
        bvalid_reg <= 1'b0;
    end
    if (s_axil_rready) begin
        rvalid_reg <= 1'b0;
    end

    // kernel events
    if (ap_done) begin
        ap_done_reg <= 1'b1;
    end
    if (ap_ready) begin
        ap_ready_reg <= 1'b1;
        ap_start_reg <= auto_restart_reg;
    end
    if (ap_done && ier_reg[0]) begin
        isr_reg[0] <= 1'b1;
    end
    if (ap_ready && ier_reg[1]) begin
        isr_reg[1] <= 1'b1;
    end

    if (do_write) begin
        awready_reg <= 1'b1;
        bvalid_reg <= 1'b1;
        if (waddr == REG_CTRL) begin
            if (s_axil_wstrb[0]) begin
                if (s_axil_wdata[CTRL_AP_START_BIT]) begin
                    ap_start_reg <= 1'b1;
                end
                auto_restart_reg <= s_axil_wdata[CTRL_AUTO_RESTART_BIT];
            end
        end else if (waddr == REG_GIE) begin
            if (s_axil_wstrb[0]) begin
                gie_reg <= s_axil_wdata[GIE_ENABLE_BIT];
            end
        end else if (waddr == REG_IER) begin
            if (s_axil_wstrb[0]) begin
                ier_reg <= s_axil_wdata[1:0];
            end
        end else if (waddr == REG_ISR) begin
            if (s_axil_wstrb[0]) begin
                isr_reg <= isr_reg ^ s_axil_wdata[1:0];
            end
        end else begin
            for (i = 0; i < ARG_WORDS; i = i + 1) begin
                if (waddr == ARG_FIRST + 4*i[ADDR_WIDTH-1:0]) begin
                    arg_reg[i] <= apply_strb(arg_reg[i], s_axil_wdata, s_axil_wstrb);
                end
            end
            for (i = 0; i < ARG2_WORDS; i = i + 1) begin
                if (waddr == ARG2_FIRST + 4*i[ADDR_WIDTH-1:0]) begin
                    arg2_reg[i] <= apply_strb(arg2_reg[i], s_axil_wdata, s_axil_wstrb);
                end
            end
        end
    end

    read_reg <= do_read;
    if (do_read) begin
        arready_reg <= 1'b1;
        raddr_reg <= raddr;
    end
    group_read_reg <= read_reg;
    if (read_reg) begin
        for (i = 0; i < GROUPS; i = i + 1) begin
            group_word_reg[i] <= read_word[8*i + {29'd0, raddr_reg[4:2]}];
        end
        group_reg <= raddr_reg[ADDR_WIDTH-1:5];
        if (raddr_reg == REG_CTRL) begin
            // clear on read, unless the event arrives in this very clock
            if (!ap_done) ap_done_reg <= 1'b0;
            if (!ap_ready) ap_ready_reg <= 1'b0;
        end
    end
    if (group_read_reg) begin
        rvalid_reg <= 1'b1;
        rdata_reg <= group_word_reg[group_reg];
    end

    if (rst) begin
        awready_reg <= 1'b0;
        bvalid_reg <= 1'b0;
        arready_reg <= 1'b0;
        read_reg <= 1'b0;
        group_read_reg <= 1'b0;
        rvalid_reg <= 1'b0;
        ap_start_reg <= 1'b0;
        ap_done_reg <= 1'b0;
        ap_ready_reg <= 1'b0;
        auto_restart_reg <= 1'b0;
        gie_reg <= 1'b0;
        ier_reg <= 2'd0;
        isr_reg <= 2'd0;
    end
end

endmodule

`resetall
