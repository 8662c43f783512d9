# Vivado block design for l2l_optim on a Zynq UltraScale+ board (ZCU104 / Kria KV260 /
# Ultra96 class): the kernel's AXI4 master on an HP slave port of the PS (DDR), its
# AXI4-Lite control slave on HPM0_FPD, the interrupt on pl_ps_irq0.
# UNTESTED: written without a board or a Vivado install; see docs/BOARD.md.
#
# vivado -mode batch -source hdl/board/build_bd.tcl -tclargs <part> [DATA_WIDTH]
#   e.g. xczu7ev-ffvc1156-2-e (ZCU104), xck26-sfvc784-2LV-c (KV260)
# Output: build/l2l_optim.bit and build/l2l_optim.hwh (PYNQ needs both, same basename).

set part       [lindex $argv 0]
set data_width [expr {[llength $argv] > 1 ? [lindex $argv 1] : 128}]
set here       [file dirname [file normalize [info script]]]
set hdl        [file dirname $here]
set build      [file join [pwd] build]

create_project -force l2l_optim_bd $build/proj -part $part
# headers: the register map, the unit latencies and the lane's schedule
set headers [glob $hdl/*.vh $hdl/fp/*.vh]
add_files [concat [glob $hdl/*.v $hdl/fp/*.v] $headers]
set_property include_dirs [list $hdl $hdl/fp] [current_fileset]
set_property file_type {Verilog Header} [get_files $headers]
update_compile_order -fileset sources_1

create_bd_design l2l
# the PS with its board preset (DDR, clocks); HP0 at the kernel's width, HPM0 for control
set ps [create_bd_cell -type ip -vlnv xilinx.com:ip:zynq_ultra_ps_e ps]
apply_bd_automation -rule xilinx.com:bd_rule:zynq_ultra_ps_e -config {apply_board_preset "1"} $ps
set_property -dict [list \
    CONFIG.PSU__USE__S_AXI_GP2 {1} \
    CONFIG.PSU__SAXIGP2__DATA_WIDTH $data_width \
    CONFIG.PSU__USE__M_AXI_GP0 {1} \
    CONFIG.PSU__USE__M_AXI_GP1 {0} \
    CONFIG.PSU__MAXIGP0__DATA_WIDTH {32} \
    CONFIG.PSU__USE__IRQ0 {1} \
    CONFIG.PSU__CRL_APB__PL0_REF_CTRL__FREQMHZ {200} \
] $ps

# the kernel as an RTL module reference (no IP packaging needed)
set k [create_bd_cell -type module -reference l2l_optim l2l_optim_0]
set_property -dict [list CONFIG.DATA_WIDTH $data_width CONFIG.ADDR_WIDTH {49}] $k

# control: HPM0_FPD -> SmartConnect -> s_axil (AXI4-Lite, 8-bit address space)
apply_bd_automation -rule xilinx.com:bd_rule:axi4 -config [list \
    Master /ps/M_AXI_HPM0_FPD Slave /l2l_optim_0/s_axil Clk_xbar Auto Clk_master Auto Clk_slave Auto] \
    [get_bd_intf_pins l2l_optim_0/s_axil]
# data: m_axi -> SmartConnect -> S_AXI_HP0_FPD (DDR); the buffers come from pynq.allocate
apply_bd_automation -rule xilinx.com:bd_rule:axi4 -config [list \
    Master /l2l_optim_0/m_axi Slave /ps/S_AXI_HP0_FPD Clk_xbar Auto Clk_master Auto Clk_slave Auto] \
    [get_bd_intf_pins ps/S_AXI_HP0_FPD]
connect_bd_net [get_bd_pins l2l_optim_0/interrupt] [get_bd_pins ps/pl_ps_irq0]
# the kernel's reset is active high: take peripheral_reset of the automation's proc_sys_reset
set rst [get_bd_cells -filter {VLNV =~ *proc_sys_reset*}]
connect_bd_net [get_bd_pins [lindex $rst 0]/peripheral_reset] [get_bd_pins l2l_optim_0/rst]

assign_bd_address
# control window: 64 KiB is the smallest SmartConnect/PS window; the map uses 0x00-0xB7
set_property range 64K [get_bd_addr_segs {ps/Data/SEG_l2l_optim_0_reg0}]
validate_bd_design
save_bd_design

make_wrapper -files [get_files l2l.bd] -top
add_files -norecurse [file join $build/proj l2l_optim_bd.gen sources_1 bd l2l hdl l2l_wrapper.v]
set_property top l2l_wrapper [current_fileset]
launch_runs impl_1 -to_step write_bitstream -jobs 4
wait_on_run impl_1

file mkdir $build
file copy -force [glob $build/proj/l2l_optim_bd.runs/impl_1/*.bit] $build/l2l_optim.bit
file copy -force [glob $build/proj/l2l_optim_bd.gen/sources_1/bd/l2l/hw_handoff/*.hwh] $build/l2l_optim.hwh
puts "wrote $build/l2l_optim.bit and $build/l2l_optim.hwh"
