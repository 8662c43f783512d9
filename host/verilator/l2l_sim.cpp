// SPDX-License-Identifier: Apache-2.0
// Verilator harness of l2l_optim: the Verilated kernel plus a C++ AXI4 memory
// model standing for the board's DRAM, behind a C ABI loaded from Python with
// ctypes (l2l_hw/hw/verilator.py).
//
// The memory model is a flat byte array. It takes every AR and AW at once
// (up to MAX_OUTSTANDING bursts queued), returns R beats in request order, one
// per clock, each burst no earlier than `read_latency` clocks after its AR
// handshake (pipelined: any number of bursts in flight), accepts W beats on
// every clock, applies them to the oldest AW with their byte strobes and
// answers B in order. Fault hooks for tests: a response code (SLVERR = 2) for
// every burst touching an address window, and a switch that holds AR ready low
// (the kernel then never finishes).
//
// Clocking happens here, not in Python: run_until_done clocks the model until
// the kernel's interrupt output rises (the driver enables GIE and IER.DONE).
//
// Compute units: l2l_sim_create_unit adds another l2l_optim instance (its own
// VerilatedContext and AXI4 port queues) on the same DRAM array, as a board
// holding several kernel instances on one memory. Each unit may be clocked on
// its own thread; the units must then work on disjoint DATA_WIDTH/8-aligned
// address ranges (the driver splits a tensor that way), so no byte is written
// by one thread while another reads or writes it. The fault hooks belong to the
// memory: they apply to every unit.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>

#include "Vl2l_optim.h"
#include "verilated.h"

#ifndef DATA_WIDTH
#error "build with -DDATA_WIDTH=<the RTL parameter>"
#endif

namespace {

constexpr int DATA_BYTES = DATA_WIDTH / 8;
constexpr size_t MAX_OUTSTANDING = 64;  // bursts queued per direction before AR/AW ready drops
static_assert(DATA_BYTES <= 64, "write strobes are read into 64 bits");
constexpr uint64_t FULL_STROBE = DATA_BYTES == 64 ? ~uint64_t(0) : (uint64_t(1) << DATA_BYTES) - 1;

struct Burst {
    uint64_t addr;
    uint32_t beats;
    uint32_t bytes;     // bytes per beat (1 << size)
    uint64_t ready_at;  // cycle from which its first R beat may go out
    uint8_t resp;
};

// Lane access to a data bus of any width: VlWide for > 64 bits, QData/IData below.
template <typename T> inline void bus_from_bytes(T& bus, const uint8_t* src) {
    if constexpr (sizeof(T) <= 8) {
        uint64_t v = 0;
        std::memcpy(&v, src, DATA_BYTES);
        bus = static_cast<T>(v);
    } else {
        std::memcpy(bus.data(), src, DATA_BYTES);
    }
}
template <typename T> inline const uint8_t* bus_bytes(const T& bus) {
    if constexpr (sizeof(T) <= 8) return reinterpret_cast<const uint8_t*>(&bus);  // little-endian host
    else return reinterpret_cast<const uint8_t*>(bus.data());
}

// The board's DRAM, shared by every compute unit, with the fault hooks.
struct Dram {
    uint8_t* bytes = nullptr;
    uint64_t size = 0;
    uint64_t err_lo = 0, err_hi = 0;  // set only while no unit runs
    uint8_t err_read = 0, err_write = 0;
    std::atomic<bool> hold_ar{false};

    explicit Dram(uint64_t n)
        // calloc: pages are mapped on first touch, so a large DRAM costs nothing up front
        : bytes(static_cast<uint8_t*>(std::calloc(n, 1))), size(bytes ? n : 0) {}
    ~Dram() { std::free(bytes); }
};

struct Sim {
    std::unique_ptr<VerilatedContext> ctx;
    std::unique_ptr<Vl2l_optim> top;
    std::shared_ptr<Dram> mem;  // the last unit destroyed frees it
    uint8_t* dram = nullptr;    // mem->bytes, mem->size
    uint64_t dram_bytes = 0;
    uint64_t cycle = 0;
    uint32_t read_latency = 0;
    // memory model state (this unit's AXI4 port)
    std::deque<Burst> reads, writes;
    std::deque<uint8_t> bresps;
    uint32_t r_beat = 0, w_beat = 0;
    uint64_t out_of_range = 0;  // beats addressed beyond the DRAM (answered DECERR)

    uint8_t resp_for(uint64_t addr, uint64_t len, uint8_t code) const {
        if (addr + len > dram_bytes) return 3;  // DECERR
        if (code && addr < mem->err_hi && addr + len > mem->err_lo) return code;
        return 0;
    }

    void drive() {
        Vl2l_optim& t = *top;
        t.m_axi_arready = !mem->hold_ar.load(std::memory_order_relaxed) && reads.size() < MAX_OUTSTANDING;
        t.m_axi_awready = writes.size() < MAX_OUTSTANDING;
        t.m_axi_wready = !writes.empty();
        bool rv = !reads.empty() && reads.front().ready_at <= cycle;
        t.m_axi_rvalid = rv;
        if (rv) {
            const Burst& b = reads.front();
            uint64_t a = b.addr + uint64_t(r_beat) * b.bytes;
            uint64_t base = a & ~uint64_t(DATA_BYTES - 1);
            if (base + DATA_BYTES <= dram_bytes) bus_from_bytes(t.m_axi_rdata, dram + base);
            t.m_axi_rlast = (r_beat + 1 == b.beats);
            t.m_axi_rresp = b.resp;
            t.m_axi_rid = 0;
        } else {
            t.m_axi_rlast = 0;
        }
        t.m_axi_bvalid = !bresps.empty();
        t.m_axi_bresp = bresps.empty() ? 0 : bresps.front();
        t.m_axi_bid = 0;
    }

    // One clock: inputs were set by drive(); sample handshakes on the settled
    // low phase, rise the clock, then update the model and drive again.
    void tick() {
        Vl2l_optim& t = *top;
        t.clk = 0;
        t.eval();
        const bool ar = t.m_axi_arvalid && t.m_axi_arready;
        const bool aw = t.m_axi_awvalid && t.m_axi_awready;
        const bool w = t.m_axi_wvalid && t.m_axi_wready;
        const bool r = t.m_axi_rvalid && t.m_axi_rready;
        const bool b = t.m_axi_bvalid && t.m_axi_bready;
        Burst arb{}, awb{};
        if (ar) {
            arb.addr = t.m_axi_araddr; arb.beats = t.m_axi_arlen + 1u; arb.bytes = 1u << t.m_axi_arsize;
            arb.ready_at = cycle + 1 + read_latency;
            arb.resp = resp_for(arb.addr, uint64_t(arb.beats) * arb.bytes, mem->err_read);
        }
        if (aw) {
            awb.addr = t.m_axi_awaddr; awb.beats = t.m_axi_awlen + 1u; awb.bytes = 1u << t.m_axi_awsize;
            awb.resp = resp_for(awb.addr, uint64_t(awb.beats) * awb.bytes, mem->err_write);
        }
        uint8_t wdata[DATA_BYTES];
        uint64_t wstrb = 0;
        bool wlast = false;
        if (w) {
            std::memcpy(wdata, bus_bytes(t.m_axi_wdata), DATA_BYTES);
            wstrb = uint64_t(t.m_axi_wstrb);
            wlast = t.m_axi_wlast;
        }
        t.clk = 1;
        t.eval();
        ++cycle;
        if (r) {
            if (++r_beat == reads.front().beats) { reads.pop_front(); r_beat = 0; }
        }
        if (b) bresps.pop_front();
        if (ar) reads.push_back(arb);
        if (aw) writes.push_back(awb);
        if (w) {  // wready is high only with an AW queued, so writes.front() exists
            Burst& wb = writes.front();
            uint64_t a = (wb.addr + uint64_t(w_beat) * wb.bytes) & ~uint64_t(DATA_BYTES - 1);
            if (wb.resp == 0) {
                if (wstrb == FULL_STROBE) {  // every beat but a run's last
                    std::memcpy(dram + a, wdata, DATA_BYTES);
                } else {
                    for (int i = 0; i < DATA_BYTES; ++i)
                        if ((wstrb >> i) & 1) dram[a + i] = wdata[i];
                }
            }
            ++w_beat;
            if (wlast || w_beat == wb.beats) {
                bresps.push_back(wb.resp);
                writes.pop_front();
                w_beat = 0;
            }
        }
        drive();
    }

    void idle_axil() {
        Vl2l_optim& t = *top;
        t.s_axil_awvalid = 0; t.s_axil_wvalid = 0; t.s_axil_bready = 0;
        t.s_axil_arvalid = 0; t.s_axil_rready = 0;
        t.s_axil_awprot = 0; t.s_axil_arprot = 0;
    }

    void reset() {
        reads.clear(); writes.clear(); bresps.clear();
        r_beat = w_beat = 0;
        Vl2l_optim& t = *top;
        idle_axil();
        t.m_axi_arready = 0; t.m_axi_awready = 0; t.m_axi_wready = 0;
        t.m_axi_rvalid = 0; t.m_axi_bvalid = 0;
        t.rst = 1;
        for (int i = 0; i < 8; ++i) tick();
        t.rst = 0;
        for (int i = 0; i < 2; ++i) tick();
    }
};

Sim* new_unit(std::shared_ptr<Dram> mem) {
    auto* s = new Sim();
    s->ctx = std::make_unique<VerilatedContext>();
    s->top = std::make_unique<Vl2l_optim>(s->ctx.get(), "l2l_optim");
    s->mem = std::move(mem);
    s->dram = s->mem->bytes;
    s->dram_bytes = s->mem->size;
    s->reset();
    return s;
}

}  // namespace

extern "C" {

// Every function returns 0 or a count on success, a negative value on error.

// A kernel instance with a DRAM of its own; nullptr if the DRAM cannot be allocated.
void* l2l_sim_create(uint64_t dram_bytes) {
    auto mem = std::make_shared<Dram>(dram_bytes);
    if (!mem->bytes) return nullptr;
    return new_unit(std::move(mem));
}

// Another kernel instance (compute unit) on the DRAM of `other`.
void* l2l_sim_create_unit(void* other) { return new_unit(static_cast<Sim*>(other)->mem); }

void l2l_sim_destroy(void* h) {
    auto* s = static_cast<Sim*>(h);
    if (!s) return;
    s->top->final();
    delete s;
}

void l2l_sim_reset(void* h) { static_cast<Sim*>(h)->reset(); }

int32_t l2l_sim_data_width() { return DATA_WIDTH; }

// AXI4-Lite write through the handshakes; returns BRESP, or -1 if the slave did
// not answer within max_cycles.
int32_t l2l_sim_axil_write(void* h, uint32_t addr, uint32_t data, uint64_t max_cycles) {
    auto* s = static_cast<Sim*>(h);
    Vl2l_optim& t = *s->top;
    t.s_axil_awaddr = addr; t.s_axil_awvalid = 1;
    t.s_axil_wdata = data; t.s_axil_wstrb = 0xF; t.s_axil_wvalid = 1;
    t.s_axil_bready = 1;
    for (uint64_t i = 0; i < max_cycles; ++i) {
        t.clk = 0; t.eval();
        const bool aw = t.s_axil_awvalid && t.s_axil_awready;
        const bool w = t.s_axil_wvalid && t.s_axil_wready;
        const bool b = t.s_axil_bvalid && t.s_axil_bready;
        const int resp = t.s_axil_bresp;
        s->tick();
        if (aw) t.s_axil_awvalid = 0;
        if (w) t.s_axil_wvalid = 0;
        if (b) { s->idle_axil(); return resp; }
    }
    s->idle_axil();
    return -1;
}

// AXI4-Lite read; returns 0 and stores the word, or -1 on no answer, or
// -(2 + RRESP) on an error response.
int32_t l2l_sim_axil_read(void* h, uint32_t addr, uint32_t* data, uint64_t max_cycles) {
    auto* s = static_cast<Sim*>(h);
    Vl2l_optim& t = *s->top;
    t.s_axil_araddr = addr; t.s_axil_arvalid = 1; t.s_axil_rready = 1;
    for (uint64_t i = 0; i < max_cycles; ++i) {
        t.clk = 0; t.eval();
        const bool ar = t.s_axil_arvalid && t.s_axil_arready;
        const bool r = t.s_axil_rvalid && t.s_axil_rready;
        const uint32_t word = t.s_axil_rdata;
        const int resp = t.s_axil_rresp;
        s->tick();
        if (ar) t.s_axil_arvalid = 0;
        if (r) {
            s->idle_axil();
            *data = word;
            return resp ? -(2 + resp) : 0;
        }
    }
    s->idle_axil();
    return -1;
}

// Clock until the interrupt output is high; returns the clocks run, or -1 if
// it stayed low for max_cycles.
int64_t l2l_sim_run_until_interrupt(void* h, uint64_t max_cycles) {
    auto* s = static_cast<Sim*>(h);
    // Verilator renames the port `interrupt` (a reserved word to it) to __SYM__interrupt.
    // It is a register output: its value after a clock edge is valid without another eval.
    if (s->top->__SYM__interrupt) return 0;
    for (uint64_t i = 1; i <= max_cycles; ++i) {
        s->tick();
        if (s->top->__SYM__interrupt) return int64_t(i);
    }
    return -1;
}

int32_t l2l_sim_dram_write(void* h, uint64_t addr, const void* src, uint64_t nbytes) {
    auto* s = static_cast<Sim*>(h);
    if (addr + nbytes > s->dram_bytes || addr + nbytes < addr) return -1;
    std::memcpy(s->dram + addr, src, nbytes);
    return 0;
}

int32_t l2l_sim_dram_read(void* h, uint64_t addr, void* dst, uint64_t nbytes) {
    auto* s = static_cast<Sim*>(h);
    if (addr + nbytes > s->dram_bytes || addr + nbytes < addr) return -1;
    std::memcpy(dst, s->dram + addr, nbytes);
    return 0;
}

// Fault injection: bursts touching [lo, hi) answer `read_resp` on R and
// `write_resp` on B (0 OKAY, 2 SLVERR, 3 DECERR); writes with an error response
// change nothing. hi == lo clears it. The window is the memory's: every unit sees it.
void l2l_sim_inject_error(void* h, uint64_t lo, uint64_t hi, uint32_t read_resp, uint32_t write_resp) {
    Dram& m = *static_cast<Sim*>(h)->mem;
    m.err_lo = lo; m.err_hi = hi;
    m.err_read = uint8_t(read_resp & 3); m.err_write = uint8_t(write_resp & 3);
}

// Hold AR ready low (1) or release it (0) on every unit: a held kernel never finishes.
void l2l_sim_hold_reads(void* h, int32_t hold) { static_cast<Sim*>(h)->mem->hold_ar = hold != 0; }

void l2l_sim_set_read_latency(void* h, uint32_t clocks) { static_cast<Sim*>(h)->read_latency = clocks; }

uint64_t l2l_sim_cycles(void* h) { return static_cast<Sim*>(h)->cycle; }

}  // extern "C"
