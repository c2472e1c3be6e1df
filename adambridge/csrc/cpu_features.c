/* cpu_features.c: what this CPU and its OS can run, read once with cpuid and xgetbv.
 *
 * An AVX bit in cpuid says the CPU has the instructions; only XCR0 (xgetbv) says the OS saves
 * the YMM / ZMM registers on a context switch. Both must hold before a kernel may use them.
 * Also the L2 cache size (cpuid leaf 0x80000006 on AMD, leaf 4 on Intel, sysconf fallback).
 */
#include "codecs.h"

#if defined(__linux__) || defined(__APPLE__) || defined(__unix__)
#include <unistd.h>
#endif
#include <stdio.h>

#if defined(AB_X86_64)
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static void ab_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4])
{
    int v[4];
    __cpuidex(v, (int)leaf, (int)sub);
    for (int k = 0; k < 4; k++)
        r[k] = (uint32_t)v[k];
}
static uint64_t ab_xgetbv0(void) { return _xgetbv(0); }
#else
#include <cpuid.h>
static void ab_cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4])
{
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}
static uint64_t ab_xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

/* Bits: cpuid(1).ecx, cpuid(7,0).ebx, XCR0. */
#define AB_CPUID1_FMA (1u << 12)
#define AB_CPUID1_OSXSAVE (1u << 27)
#define AB_CPUID1_AVX (1u << 28)
#define AB_CPUID1_F16C (1u << 29)
#define AB_CPUID7_AVX2 (1u << 5)
#define AB_CPUID7_AVX512F (1u << 16)
#define AB_CPUID7_AVX512BW (1u << 30)
#define AB_CPUID7_AVX512VL (1u << 31)
#define AB_XCR0_YMM 0x06u   /* SSE + AVX state */
#define AB_XCR0_ZMM 0xe6u   /* SSE + AVX + opmask + ZMM0-15 upper + ZMM16-31 */

typedef struct {
    int avx2;     /* AVX2 + FMA + F16C, YMM state enabled by the OS */
    int avx512;   /* AVX-512 F/BW/VL, ZMM and opmask state enabled by the OS */
} ab_x86_features;

static ab_x86_features ab_x86_detect(void)
{
    ab_x86_features f = {0, 0};
    uint32_t r[4];
    ab_cpuid(0, 0, r);
    uint32_t max_leaf = r[0];
    if (max_leaf < 7)
        return f;
    ab_cpuid(1, 0, r);
    uint32_t ecx1 = r[2];
    if (!(ecx1 & AB_CPUID1_OSXSAVE))
        return f;                                /* no xgetbv: the OS does not use XSAVE */
    uint64_t xcr0 = ab_xgetbv0();
    ab_cpuid(7, 0, r);
    uint32_t ebx7 = r[1];
    uint32_t need1 = AB_CPUID1_AVX | AB_CPUID1_FMA | AB_CPUID1_F16C;
    f.avx2 = (ecx1 & need1) == need1 && (ebx7 & AB_CPUID7_AVX2) &&
             (xcr0 & AB_XCR0_YMM) == AB_XCR0_YMM;
    uint32_t need7 = AB_CPUID7_AVX512F | AB_CPUID7_AVX512BW | AB_CPUID7_AVX512VL;
    f.avx512 = f.avx2 && (ebx7 & need7) == need7 && (xcr0 & AB_XCR0_ZMM) == AB_XCR0_ZMM;
    return f;
}

int ab_cpu_has_avx2(void) { return ab_x86_detect().avx2; }
int ab_cpu_has_avx512(void) { return ab_x86_detect().avx512; }
#else
int ab_cpu_has_avx2(void) { return 0; }
int ab_cpu_has_avx512(void) { return 0; }
#endif

/* Advanced SIMD is part of the AArch64 base architecture. */
int ab_cpu_has_neon(void)
{
#if defined(AB_AARCH64)
    return 1;
#else
    return 0;
#endif
}

/* ---- L2 cache size ----------------------------------------------------------------------- */

#if defined(AB_X86_64)
static int64_t ab_l2_cpuid(void)
{
    uint32_t r[4];
    ab_cpuid(0, 0, r);
    uint32_t max_leaf = r[0];
    char vendor[13];
    memcpy(vendor + 0, &r[1], 4);
    memcpy(vendor + 4, &r[3], 4);
    memcpy(vendor + 8, &r[2], 4);
    vendor[12] = 0;
    if (!strcmp(vendor, "AuthenticAMD") || !strcmp(vendor, "HygonGenuine")) {
        ab_cpuid(0x80000000u, 0, r);
        if (r[0] < 0x80000006u)
            return 0;
        ab_cpuid(0x80000006u, 0, r);
        return (int64_t)(r[2] >> 16) * 1024;      /* ecx[31:16]: L2 size in KiB */
    }
    if (max_leaf < 4)
        return 0;
    for (uint32_t sub = 0; sub < 16; sub++) {     /* deterministic cache parameters */
        ab_cpuid(4, sub, r);
        uint32_t type = r[0] & 0x1f, level = (r[0] >> 5) & 0x7;
        if (type == 0)
            break;
        if (level == 2 && (type == 1 || type == 3)) {   /* data or unified */
            int64_t ways = ((r[1] >> 22) & 0x3ff) + 1, parts = ((r[1] >> 12) & 0x3ff) + 1;
            int64_t line = (r[1] & 0xfff) + 1, sets = (int64_t)r[2] + 1;
            return ways * parts * line * sets;
        }
    }
    return 0;
}
#endif

AB_API int64_t ab_l2_cache_bytes(void)
{
    int64_t bytes = 0;
#if defined(AB_X86_64)
    bytes = ab_l2_cpuid();
#endif
#if defined(_SC_LEVEL2_CACHE_SIZE)
    if (bytes <= 0) {
        long s = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = s > 0 ? (int64_t)s : 0;
    }
#endif
#if defined(__linux__)
    if (bytes <= 0) {                              /* e.g. aarch64, where glibc reports 0 */
        FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index2/size", "r");
        if (f) {
            long kib = 0;
            if (fscanf(f, "%ldK", &kib) == 1 && kib > 0)
                bytes = (int64_t)kib * 1024;
            fclose(f);
        }
    }
#endif
    return bytes;
}
