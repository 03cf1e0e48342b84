// ISO3_0 / ISO4_0 shared device code: quaternion and centroid tables, exact-rounding helpers.
// Plain CUDA with no toolkit header (prelude.cuh), so NVRTC compiles every .cu file alone.
// Formats and operation order: specs/iso_kv.md §1-§4; the torch reference is kernels/iso/ref.py.
#pragma once

#include "dependent_launch.cuh"
#include "prelude.cuh"

namespace iso {

constexpr int kBlock = 128;

// Set A quaternions (w, x, y, z), one per 4-D group of a 128-block.
#define ISO_SET_A_QUATERNIONS \
  { \
    {0.5765609741f, 0.4450169504f, 0.2695076466f, -0.6300023794f}, \
    {0.3176580369f, -0.5780548453f, -0.0201656222f, -0.7513582706f}, \
    {-0.3234235942f, 0.7089627385f, -0.1687686443f, -0.6035611629f}, \
    {-0.5127438903f, -0.3940812945f, -0.5415957570f, 0.5370919704f}, \
    {0.9233905673f, -0.0897334740f, -0.2796611190f, 0.2471584976f}, \
    {-0.3323571086f, 0.4727236331f, 0.3510629535f, 0.7367672324f}, \
    {0.5468608141f, 0.5542563796f, 0.2609911859f, 0.5706370473f}, \
    {-0.2500519454f, 0.0450818054f, -0.2715902030f, 0.9282674193f}, \
    {-0.5812215805f, -0.3657043576f, -0.0937586129f, 0.7208684087f}, \
    {0.3228830695f, -0.4298477769f, 0.3095585108f, -0.7843156457f}, \
    {-0.7299832702f, 0.4666220546f, -0.4123268127f, -0.2817355990f}, \
    {-0.4535493255f, 0.7556306720f, -0.4394895136f, -0.1736787707f}, \
    {-0.7338157296f, -0.5284956098f, 0.0626545250f, 0.4222335219f}, \
    {-0.2884652913f, 0.7042509317f, -0.4811822474f, -0.4350655377f}, \
    {-0.9000198841f, 0.0230921544f, -0.0407132693f, 0.4333281815f}, \
    {-0.0377033800f, 0.7110687494f, -0.4566248953f, 0.5333415866f}, \
    {0.5104404092f, 0.3024962246f, 0.7834537029f, 0.1847889870f}, \
    {0.2033989877f, -0.1157865301f, -0.6187923551f, 0.7498788238f}, \
    {-0.2462528497f, 0.7490812540f, 0.0809760988f, 0.6096553802f}, \
    {0.2314069420f, -0.2582575679f, -0.8879503012f, -0.3021556735f}, \
    {0.0072374810f, -0.2255804837f, -0.8928058147f, -0.3898189068f}, \
    {0.3923372924f, 0.3838746250f, 0.8350352049f, 0.0377884321f}, \
    {0.4958070219f, -0.3209520578f, -0.6994170547f, 0.4024685621f}, \
    {-0.7235037088f, -0.3477301002f, 0.5606835485f, 0.2031257302f}, \
    {-0.9383618832f, 0.1824720055f, 0.2933705449f, 0.0107116764f}, \
    {0.4430379272f, 0.4032751918f, 0.7377059460f, -0.3112498820f}, \
    {-0.2075705230f, 0.8433781862f, 0.4534837306f, 0.1999502629f}, \
    {0.1983736306f, 0.9533935785f, -0.0009816211f, -0.2273492515f}, \
    {-0.8834578991f, -0.0620501526f, -0.3632916510f, 0.2892593443f}, \
    {0.7389573455f, 0.0927560627f, -0.3959124386f, 0.5372074246f}, \
    {-0.0156172011f, 0.2964956462f, 0.1631654203f, 0.9408631325f}, \
    {0.7738668919f, 0.2402082384f, 0.5088164806f, 0.2907505929f} \
  }
static __constant__ float kQuat[32][4] = ISO_SET_A_QUATERNIONS;
// The same table in global memory, one 16-byte row per group: for code where each lane
// takes its own quaternion (constant memory serves one address at a time, so 32 lanes on
// 32 groups cost 32 replays per load; one 16-byte load per lane from here costs one).
static __device__ __align__(16) const float kQuatRows[32][4] = ISO_SET_A_QUATERNIONS;

static __constant__ float kCent3[8] = {-0.1906850000f, -0.1178320000f, -0.0657170000f,
                                       -0.0214600000f, 0.0214600000f,  0.0657170000f,
                                       0.1178320000f,  0.1906850000f};
static __constant__ float kCent4[16] = {
    -0.1739260000f, -0.1171950000f, -0.0895270000f, -0.0687560000f, -0.0512620000f, -0.0355970000f,
    -0.0209890000f, -0.0069380000f, 0.0069380000f,  0.0209890000f,  0.0355970000f,  0.0512620000f,
    0.0687560000f,  0.0895270000f,  0.1171950000f,  0.1739260000f};

template <int BITS>
struct Fmt;
template <>
struct Fmt<3> {
  static constexpr int kBytes = 50;
  static constexpr int kCents = 8;
};
template <>
struct Fmt<4> {
  static constexpr int kBytes = 68;
  static constexpr int kCents = 16;
};

template <int BITS>
__device__ __forceinline__ float centroid(int i) {
  return BITS == 3 ? kCent3[i] : kCent4[i];
}

// Left quaternion product r = q (x) v, left to right, one rounding per operation (no FMA).
// conj=true multiplies by the conjugate (the inverse rotation).
__device__ __forceinline__ void rotate_exact(int g, bool conj, const float v[4], float r[4]) {
  const float qw = kQuat[g][0];
  const float qx = conj ? -kQuat[g][1] : kQuat[g][1];
  const float qy = conj ? -kQuat[g][2] : kQuat[g][2];
  const float qz = conj ? -kQuat[g][3] : kQuat[g][3];
  r[0] = __fsub_rn(__fsub_rn(__fsub_rn(__fmul_rn(qw, v[0]), __fmul_rn(qx, v[1])),
                             __fmul_rn(qy, v[2])), __fmul_rn(qz, v[3]));
  r[1] = __fsub_rn(__fadd_rn(__fadd_rn(__fmul_rn(qw, v[1]), __fmul_rn(qx, v[0])),
                             __fmul_rn(qy, v[3])), __fmul_rn(qz, v[2]));
  r[2] = __fadd_rn(__fadd_rn(__fsub_rn(__fmul_rn(qw, v[2]), __fmul_rn(qx, v[3])),
                             __fmul_rn(qy, v[0])), __fmul_rn(qz, v[1]));
  r[3] = __fadd_rn(__fsub_rn(__fadd_rn(__fmul_rn(qw, v[3]), __fmul_rn(qx, v[2])),
                             __fmul_rn(qy, v[1])), __fmul_rn(qz, v[0]));
}

// Group g's quaternion, one 16-byte load from kQuatRows.
__device__ __forceinline__ float4 quat_row(int g) {
  return reinterpret_cast<const float4*>(kQuatRows)[g];
}

// The same rotation with ordinary (contractible) arithmetic, for attention math, by the
// quaternion q (w, x, y, z) = (q.x, q.y, q.z, q.w).
__device__ __forceinline__ void rotate_by(float4 q, bool conj, const float v[4], float r[4]) {
  const float qw = q.x;
  const float qx = conj ? -q.y : q.y;
  const float qy = conj ? -q.z : q.z;
  const float qz = conj ? -q.w : q.w;
  r[0] = qw * v[0] - qx * v[1] - qy * v[2] - qz * v[3];
  r[1] = qw * v[1] + qx * v[0] + qy * v[3] - qz * v[2];
  r[2] = qw * v[2] - qx * v[3] + qy * v[0] + qz * v[1];
  r[3] = qw * v[3] + qx * v[2] - qy * v[1] + qz * v[0];
}

// The 4 centroid indices of group g (0..31) of one packed block.
template <int BITS>
__device__ __forceinline__ void group_indices(const uint8_t* blk, int g, int idx[4]) {
  if (BITS == 3) {
    const int qs = blk[2 + g];
    const int nib = (blk[34 + (g >> 1)] >> ((g & 1) * 4)) & 15;
#pragma unroll
    for (int c = 0; c < 4; ++c) idx[c] = ((qs >> (2 * c)) & 3) | (((nib >> c) & 1) << 2);
  } else {
    const int b0 = blk[4 + 2 * g];
    const int b1 = blk[5 + 2 * g];
    idx[0] = b0 & 15;
    idx[1] = b0 >> 4;
    idx[2] = b1 & 15;
    idx[3] = b1 >> 4;
  }
}

// fp32 -> IEEE binary16 bits, round to nearest even, in integer arithmetic (no f16 register:
// on sm_90 ptxas turned a byte store of a cvt.rn.f16.f32 result into F2I.U8.F16, i.e. it
// wrote the integer value of the norm instead of its low byte). Overflow gives +-inf, NaN a
// quiet NaN, values below 2^-25 give +-0, subnormals are rounded exactly.
__device__ __forceinline__ uint32_t f32_to_f16_bits(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                       // normal binary16 range (>= 2^-14)
    const uint32_t r = ax + 0x0fffu + ((ax >> 13) & 1u);
    return sign | ((r - 0x38000000u) >> 13);
  }
  if (ax < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself ties to 0)
  const uint32_t e = ax >> 23;                     // 102..112
  const uint32_t m = (ax & 0x7fffffu) | 0x800000u;  // value = m * 2^(e-150)
  const uint32_t shift = 126u - e;                 // 14..24: in units of 2^-24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | q;
}

// IEEE binary16 bits -> fp32 (exact), in integer arithmetic.
__device__ __forceinline__ float f16_bits_to_f32(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
  // zero or subnormal: m * 2^-24, exact in fp32
  const float mag = __fmul_rn((float)m, 5.9604644775390625e-08f);
  return __uint_as_float(__float_as_uint(mag) | sign);
}

__device__ __forceinline__ float block_norm(const uint8_t* blk) {
  return f16_bits_to_f32((uint32_t)blk[0] | ((uint32_t)blk[1] << 8));
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<ts::bf16>(ts::bf16 x) {
  return ts::bf16_to_float(x.bits);
}
template <>
__device__ __forceinline__ float to_float<ts::f16>(ts::f16 x) { return ts::f16_to_float(x.bits); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ ts::bf16 from_float<ts::bf16>(float x) {
  return ts::bf16{ts::float_to_bf16(x)};
}
template <>
__device__ __forceinline__ ts::f16 from_float<ts::f16>(float x) {
  return ts::f16{ts::float_to_f16(x)};
}

}  // namespace iso
