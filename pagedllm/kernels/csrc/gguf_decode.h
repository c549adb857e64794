#pragma once
// One ggml block -> float32, per kept type, in portable C++ (the compiler vectorises the
// element loops where the ISA allows). The reference for every other kernel here: the
// dequantize-rows and gather paths call it directly, and the fast dot products are tested
// against it. Layouts (byte offsets inside one block; fp16 = IEEE half, little-endian):
//   Q4_0  d@0, qs[16]@2: element j = (qs[j] & 15) - 8, j + 16 = (qs[j] >> 4) - 8, times d
//   Q4_1  d@0, m@2, qs[16]@4: q * d + m
//   Q5_0  d@0, qh u32@2, qs[16]@6: the 5th bit of element j is qh bit j; q - 16, times d
//   Q5_1  d@0, m@2, qh@4, qs@8: q * d + m
//   Q8_0  d@0, qs int8[32]@2
//   Q2_K  scales[16]@0 (low nibble scale, high nibble min, per 16 elements), qs[64]@16,
//         d@80, dmin@82: 128-element halves, 2-bit codes of byte l at shifts 0, 2, 4, 6
//   Q3_K  hmask[32]@0, qs[64]@32, scales[12]@96 (6-bit, q3k_scale), d@108: code = 2 low
//         bits - (hmask bit clear ? 4 : 0)
//   Q4_K  d@0, dmin@2, scales[12]@4 (k4_scale_min), qs[128]@16: per 64 elements, 32 bytes,
//         low nibbles then high nibbles: d sc q - dmin m
//   Q5_K  as Q4_K with qh[32]@16 (bit 2i / 2i + 1 of byte l: the 5th bit), qs[128]@48
//   Q6_K  ql[128]@0, qh[64]@128, scales int8[16]@192, d@208: per 128 elements, 64 ql bytes
//         and 32 qh bytes; code = low 4 | 2 high bits << 4, minus 32
//   IQ4_NL d@0, qs[16]@2: kIQ4Values[nibble] * d (Q4_0's nibble order)
//   IQ4_XS d@0, scales_h u16@2, scales_l[4]@4, qs[128]@8: 8 sub-blocks of 32 as IQ4_NL's
//   MXFP4 e8m0@0, qs[16]@1: kMXFP4Values[nibble] * e8m0_half(e) (Q4_0's nibble order)
#include <type_traits>

#include "gguf_types.h"

namespace pagedllm::gguf {

// 32 elements of Q4_0's nibble order through a 16-entry table (IQ4_NL, MXFP4).
inline void decode_table_nibbles(const uint8_t* qs, const int8_t* table, float d, float* y) {
  for (int j = 0; j < 16; ++j) {
    y[j] = d * table[qs[j] & 0x0F];
    y[j + 16] = d * table[qs[j] >> 4];
  }
}

template <Type T>
inline void decode_block(const uint8_t* b, float* y);

template <>
inline void decode_block<Type::Q4_0>(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float((qs[j] & 0x0F) - 8);
    y[j + 16] = d * float((qs[j] >> 4) - 8);
  }
}

template <>
inline void decode_block<Type::Q4_1>(const uint8_t* b, float* y) {
  const float d = fp16_at(b), m = fp16_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * float(qs[j] & 0x0F) + m;
    y[j + 16] = d * float(qs[j] >> 4) + m;
  }
}

template <>
inline void decode_block<Type::Q5_0>(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  const uint32_t qh = load_u32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0F) | int(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
    y[j] = d * float(lo - 16);
    y[j + 16] = d * float(hi - 16);
  }
}

template <>
inline void decode_block<Type::Q5_1>(const uint8_t* b, float* y) {
  const float d = fp16_at(b), m = fp16_at(b + 2);
  const uint32_t qh = load_u32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 0x0F) | int(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | int(((qh >> (j + 16)) & 1) << 4);
    y[j] = d * float(lo) + m;
    y[j + 16] = d * float(hi) + m;
  }
}

template <>
inline void decode_block<Type::Q8_0>(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = d * float(qs[j]);
}

template <>
inline void decode_block<Type::Q2_K>(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const float d = fp16_at(b + 80), dmin = fp16_at(b + 82);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = b + 16 + 32 * half;
    for (int shift = 0; shift < 8; shift += 2) {
      for (int part = 0; part < 2; ++part) {  // 16 elements from bytes 16 part .. 16 part + 15
        const uint8_t sc = *scales++;
        const float dl = d * float(sc & 0x0F), ml = dmin * float(sc >> 4);
        for (int l = 0; l < 16; ++l) y[l] = dl * float((q[16 * part + l] >> shift) & 3) - ml;
        y += 16;
      }
    }
  }
}

template <>
inline void decode_block<Type::Q3_K>(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* scales = b + 96;
  const float d = fp16_at(b + 108);
  int is = 0;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = b + 32 + 32 * half;
    for (int shift = 0; shift < 8; shift += 2) {
      const uint8_t bit = uint8_t(1u << (4 * half + shift / 2));
      for (int part = 0; part < 2; ++part) {
        const float dl = d * float(q3k_scale(scales, is++));
        for (int l = 0; l < 16; ++l) {
          const int i = 16 * part + l;
          y[l] = dl * float(((q[i] >> shift) & 3) - ((hmask[i] & bit) ? 0 : 4));
        }
        y += 16;
      }
    }
  }
}

// Q4_K and Q5_K share the scales and the nibble order; Q5_K adds a 5th bit per element.
template <bool FIVE>
inline void decode_k4(const uint8_t* b, float* y) {
  const float d = fp16_at(b), dmin = fp16_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  for (int j = 0; j < 8; j += 2) {
    int sc0, m0, sc1, m1;
    k4_scale_min(scales, j, sc0, m0);
    k4_scale_min(scales, j + 1, sc1, m1);
    const float d0 = d * float(sc0), min0 = dmin * float(m0);
    const float d1 = d * float(sc1), min1 = dmin * float(m1);
    for (int l = 0; l < 32; ++l) {
      const int h0 = FIVE ? ((qh[l] >> j) & 1) << 4 : 0;
      const int h1 = FIVE ? ((qh[l] >> (j + 1)) & 1) << 4 : 0;
      y[l] = d0 * float((qs[l] & 0x0F) | h0) - min0;
      y[l + 32] = d1 * float((qs[l] >> 4) | h1) - min1;
    }
    qs += 32;
    y += 64;
  }
}
template <>
inline void decode_block<Type::Q4_K>(const uint8_t* b, float* y) {
  decode_k4<false>(b, y);
}
template <>
inline void decode_block<Type::Q5_K>(const uint8_t* b, float* y) {
  decode_k4<true>(b, y);
}

template <>
inline void decode_block<Type::Q6_K>(const uint8_t* b, float* y) {
  const float d = fp16_at(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  // Per 128 elements: quarter q (32 elements) takes nibble q / 2 of ql bytes 32 (q % 2) ..
  // + 31 and bits 2q, 2q + 1 of the 32 qh bytes; each 16 elements have their own scale.
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    for (int q = 0; q < 4; ++q) {
      const uint8_t* lq = ql + 32 * (q & 1);
      const int shift_l = 4 * (q >> 1), shift_h = 2 * q;
      for (int part = 0; part < 2; ++part) {
        const float s = d * float(sc[8 * half + 2 * q + part]);
        for (int l = 16 * part; l < 16 * part + 16; ++l) {
          const int code = ((lq[l] >> shift_l) & 0x0F) | (((qh[l] >> shift_h) & 3) << 4);
          y[128 * half + 32 * q + l] = s * float(code - 32);
        }
      }
    }
  }
}

template <>
inline void decode_block<Type::IQ4_NL>(const uint8_t* b, float* y) {
  decode_table_nibbles(b + 2, kIQ4Values, fp16_at(b), y);
}

template <>
inline void decode_block<Type::IQ4_XS>(const uint8_t* b, float* y) {
  const float d = fp16_at(b);
  const uint16_t scales_h = load_u16(b + 2);
  for (int i = 0; i < 8; ++i)
    decode_table_nibbles(b + 8 + 16 * i, kIQ4Values, d * float(iq4xs_scale(scales_h, b + 4, i)), y + 32 * i);
}

template <>
inline void decode_block<Type::MXFP4>(const uint8_t* b, float* y) {
  decode_table_nibbles(b + 1, kMXFP4Values, e8m0_half(b[0]), y);
}

// Elements [k0, k0 + n) of a row of `T` -> y (k0 and n whole blocks; any for F16/BF16).
template <Type T>
inline void decode_elements(const uint8_t* row, int64_t k0, int64_t n, float* y) {
  constexpr Geometry g = kGeometry[int(T)];
  if constexpr (T == Type::F16) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp16_at(row + 2 * (k0 + i));
  } else if constexpr (T == Type::BF16) {
    for (int64_t i = 0; i < n; ++i) y[i] = bf16_to_f32(load_u16(row + 2 * (k0 + i)));
  } else {
    const uint8_t* b = row + k0 / g.elems * g.bytes;
    for (int64_t e = 0; e < n; e += g.elems, b += g.bytes) decode_block<T>(b, y + e);
  }
}

// Calls f(std::integral_constant<Type, T>) for the runtime type `t`.
template <typename F>
inline void with_type(Type t, F&& f) {
  switch (t) {
#define PAGEDLLM_GGUF_CASE(X) \
  case Type::X:               \
    f(std::integral_constant<Type, Type::X>{}); \
    break;
    PAGEDLLM_GGUF_CASE(F16) PAGEDLLM_GGUF_CASE(BF16) PAGEDLLM_GGUF_CASE(Q4_0) PAGEDLLM_GGUF_CASE(Q4_1)
    PAGEDLLM_GGUF_CASE(Q5_0) PAGEDLLM_GGUF_CASE(Q5_1) PAGEDLLM_GGUF_CASE(Q8_0) PAGEDLLM_GGUF_CASE(Q2_K)
    PAGEDLLM_GGUF_CASE(Q3_K) PAGEDLLM_GGUF_CASE(Q4_K) PAGEDLLM_GGUF_CASE(Q5_K) PAGEDLLM_GGUF_CASE(Q6_K)
    PAGEDLLM_GGUF_CASE(IQ4_NL) PAGEDLLM_GGUF_CASE(IQ4_XS) PAGEDLLM_GGUF_CASE(MXFP4)
#undef PAGEDLLM_GGUF_CASE
    default:
      break;
  }
}

}  // namespace pagedllm::gguf
