"""Hardware side of the FPGA EPS: the register map of the RTL kernel (regs.py,
generated from hdl/l2l_optim_regs.json by gen_regs.py)."""
