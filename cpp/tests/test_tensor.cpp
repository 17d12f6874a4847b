// hot/tensor.h: views, owning CPU tensors and dtype helpers.
#include "test_util.h"

namespace {

using namespace hot_test;

TEST(Cpu_Tensor, DTypeHelpers) {
  EXPECT_EQ(hot::dtype_bits(DType::f32), 32);
  EXPECT_EQ(hot::dtype_bits(DType::f16), 16);
  EXPECT_EQ(hot::dtype_bits(DType::bf16), 16);
  EXPECT_EQ(hot::dtype_bits(DType::s8), 8);
  EXPECT_EQ(hot::dtype_bits(DType::s4), 4);
  EXPECT_EQ(hot::dtype_bits(DType::s32), 32);
  EXPECT_TRUE(hot::is_float(DType::f32));
  EXPECT_TRUE(hot::is_float(DType::f16));
  EXPECT_TRUE(hot::is_float(DType::bf16));
  EXPECT_FALSE(hot::is_float(DType::s8));
  EXPECT_FALSE(hot::is_float(DType::s4));
  EXPECT_FALSE(hot::is_float(DType::s32));
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::s8, DType::s4, DType::s32})
    EXPECT_GT(std::string(hot::dtype_name(d)).size(), 0u);
  EXPECT_EQ(hot::storage_bytes(DType::s4, {3, 5}), 8u);  // 15 nibbles round up to whole bytes
  EXPECT_EQ(hot::storage_bytes(DType::f16, {3, 5}), 30u);
  EXPECT_EQ(hot::storage_bytes(DType::s32, {7}), 28u);
}

TEST(Cpu_Tensor, ViewsAndStrides) {
  EXPECT_EQ(hot::contiguous_strides({2, 3, 4}), (hot::Shape{12, 4, 1}));
  float buf[12];
  const TensorView v = hot::make_view(buf, DType::f32, hot::Device::cpu(), {3, 4});
  EXPECT_EQ(v.strides, (hot::Shape{4, 1}));
  EXPECT_EQ(v.numel(), 12);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_TRUE(v.is_row_major_2d());
  EXPECT_EQ(v.size(-1), 4);
  EXPECT_EQ(v.stride(0), 4);
  TensorView p = v;
  p.shape = {2, 4};
  p.strides = {6, 1};  // padded rows
  EXPECT_FALSE(p.is_contiguous());
  EXPECT_TRUE(p.is_row_major_2d());
  p.strides = {3, 1};  // row stride < cols
  EXPECT_FALSE(p.is_row_major_2d());
  p.strides = {1, 2};  // column-major
  EXPECT_FALSE(p.is_row_major_2d());
  EXPECT_EQ(hot::Device::cpu(), hot::Device::cpu());
  EXPECT_NE(hot::Device::cpu(), hot::Device::cuda(0));
  EXPECT_NE(hot::Device::cuda(0), hot::Device::cuda(1));
}

TEST(Cpu_Tensor, OwningTensors) {
  const hot::Tensor z = hot::Tensor::zeros(DType::s8, {5, 33}, hot::Device::cpu());
  EXPECT_TRUE(z.defined());
  EXPECT_EQ(z.nbytes(), 165u);
  EXPECT_EQ(z.view().shape, (hot::Shape{5, 33}));
  EXPECT_EQ(z.view().strides, (hot::Shape{33, 1}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(z.view().data) % 64, 0u);  // 64-byte aligned host memory
  for (int i = 0; i < 165; ++i) ASSERT_EQ(z.view().ptr<int8_t>()[i], 0);
  const hot::Tensor e = hot::Tensor::empty(DType::s4, {2, 6}, hot::Device::cpu());
  EXPECT_EQ(e.nbytes(), 6u);
  const hot::Tensor f = hot::Tensor::empty(DType::bf16, {4}, hot::Device::cpu());
  EXPECT_EQ(f.nbytes(), 8u);
}

// The fp16/bf16 helpers of test_util.h that the half-precision tests rely on.
TEST(Cpu_Tensor, TestHelpersHalfConversion) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);        // tie to even (0)
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);        // tie to even (2)
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);        // smallest normal
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);
  EXPECT_EQ(f32_to_f16(2047.0f / 1024.0f * 1.0f + std::ldexp(1.0f, -11)), 0x4000);  // carries into the exponent
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(std::nanf("")))));
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(3.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
  for (uint32_t h = 0; h < 0x7c00; ++h) ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h);
  for (uint32_t h = 0; h < 0x7f80; ++h) ASSERT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h);
}

}  // namespace
