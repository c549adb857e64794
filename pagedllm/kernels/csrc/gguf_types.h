#pragma once
// The ggml block types kept as the file's bytes (kernels/gguf_blocks.py's KEPT_GGUF_TYPES):
// their geometry, the scalar number formats inside the blocks (fp16, bf16, e8m0) and the
// packed-scale decoders the K-quants share. Portable C++ (no intrinsics): every ISA's build
// decodes scales with these.
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedllm::gguf {

// The kept types; `kTypeNames` is their Python-side spelling, in this order (the binding
// exports it, so the two sides share one list).
enum class Type : int {
  F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4, kCount
};
inline constexpr const char* kTypeNames[] = {"F16",  "BF16", "Q4_0", "Q4_1", "Q5_0",   "Q5_1",   "Q8_0", "Q2_K",
                                             "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"};

// Elements and bytes per block (F16/BF16: one value; any K).
struct Geometry {
  int elems;
  int bytes;
};
inline constexpr Geometry kGeometry[] = {{1, 2},    {1, 2},    {32, 18},  {32, 20},  {32, 22},
                                         {32, 24},  {32, 34},  {256, 84}, {256, 110}, {256, 144},
                                         {256, 176}, {256, 210}, {32, 18},  {256, 136}, {32, 17}};
// Output rows a thread takes at least per grab of the matmuls' guided schedules (a thread
// that lost its core on a shared machine does not hold the others up).
inline constexpr int kMinChunkRows = 16;

// The non-linear 4-bit code book of IQ4_NL / IQ4_XS (int8 values, times the block scale).
inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};
// MXFP4's e2m1 values doubled (0, 0.5, 1, 1.5, 2, 3, 4, 6 times two, then negated), paired
// with half the e8m0 scale (e8m0_half), as gguf-py and ggml hold them.
inline constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// IEEE half -> float, exact (normals, subnormals, inf, nan): F16C's vcvtph2ps where the
// build targets it, else integer operations (the generic build).
#if defined(__F16C__)
inline float fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  // Subnormal (or zero): man * 2^-24, exact in float32.
  const float v = float(man) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}
#endif
inline float fp16_at(const uint8_t* p) { return fp16_to_f32(load_u16(p)); }
inline float bf16_to_f32(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

// e8m0 exponent e -> 2^(e - 128): half the block scale 2^(e - 127), as MXFP4's doubled table
// wants (e < 2 gives float32 subnormals, built bit by bit as gguf-py does).
inline float e8m0_half(uint8_t e) {
  return bits_to_float(e < 2 ? (0x00200000u << e) : (uint32_t(e - 1) << 23));
}

// Q4_K / Q5_K: sub-block j (of 8, 32 elements each) has a 6-bit scale and a 6-bit min packed
// in 12 bytes: j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 as byte j + 4's two
// nibbles (low 4 bits) with the top 2 bits of bytes j - 4 and j.
inline void k4_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// All 8 of them at once: bytes i of `sc` and `m` are sub-block i's scale and min.
inline void k4_scales_mins(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);  // top 2 bits of a's bytes at 4, 5
  const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  sc = uint64_t(a & 0x3F3F3F3Fu) | uint64_t(sc_hi) << 32;
  m = uint64_t(b & 0x3F3F3F3Fu) | uint64_t(m_hi) << 32;
}

// Q3_K: sub-block i (of 16, 16 elements each) has a 6-bit scale biased by 32: the low 4 bits
// are byte i's low nibble (i < 8) or byte i - 8's high nibble, the top 2 bits are bits
// 2 (i / 4) .. 2 (i / 4) + 1 of byte 8 + i % 4.
inline int q3k_scale(const uint8_t* s, int i) {
  const int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
  const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
  return (lo | (hi << 4)) - 32;
}

// IQ4_XS: sub-block i (of 8, 32 elements each) has a 6-bit scale biased by 32: low 4 bits in
// scales_l (nibble i % 2 of byte i / 2), top 2 bits at bits 2i, 2i + 1 of scales_h.
inline int iq4xs_scale(uint16_t scales_h, const uint8_t* scales_l, int i) {
  const int lo = (scales_l[i >> 1] >> (4 * (i & 1))) & 0x0F;
  const int hi = (scales_h >> (2 * i)) & 3;
  return (lo | (hi << 4)) - 32;
}

}  // namespace pagedllm::gguf
