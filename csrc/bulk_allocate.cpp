// te::bulk_allocate — many tensors from one device allocation.
//
// Allocating hundreds of small tensors one by one (per-expert weight gradients, FP8 scale
// tensors, ...) costs an allocator call and its bookkeeping per tensor. This op makes a single
// uint8 buffer with at::empty on the requested device and carves the tensors out of it:
//
//   * tensor i starts at an address that is a multiple of max(alignments[i], itemsize);
//     the buffer is over-allocated by the largest alignment so that its own start may be
//     unaligned;
//   * tensors never overlap; zero-byte tensors are not placed in the buffer and get their own
//     (empty) allocation;
//   * the memory is uninitialised like at::empty, unless zero=true: then the whole buffer is
//     cleared with one fill (cheaper than one per tensor, and what opcheck's value comparisons
//     need);
//   * every tensor has its own Storage (storage_offset 0, contiguous), whose deleter holds a
//     reference to the buffer's Storage: the buffer lives while any of the tensors lives, on CPU
//     and CUDA alike (the CUDA caching allocator frees it on the stream it was made on).
//
// The outputs do not alias each other in the sense of PyTorch's alias analysis (distinct
// storages, disjoint bytes), which is exactly what the schema declares and what the fake
// implementation (te_compile/functional/allocate.py) produces.
//
// Schema: the per-tensor shapes are flattened, since the dispatcher has no nested lists:
// tensor i has ranks[i] dimensions, taken in order from dims. dims are SymInt so that shapes
// derived from dynamic sizes trace under torch.compile without specialisation. dtypes are
// PyTorch's names ("float32", "bfloat16", ...: str(dtype) without "torch."), because a
// ScalarType[] argument cannot be converted by opcheck's schema check (SchemaCheckMode).
#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace te {
namespace {

// Larger sizes or alignments are errors; keeps every sum below 2**64 without further checks.
constexpr uint64_t kMaxBytes = uint64_t{1} << 62;

bool is_power_of_two(int64_t x) {
  return x > 0 && (x & (x - 1)) == 0;
}

// Rounds x up to a multiple of the power of two a.
uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) & ~(a - 1);
}

// "float32" -> at::kFloat, with PyTorch's dtype names (legacy aliases like "float" included).
at::ScalarType dtype_from_name(const std::string& name, size_t index) {
  static const auto& dtypes = c10::getStringToDtypeMap();
  const auto it = dtypes.find(name);
  TORCH_CHECK_VALUE(
      it != dtypes.end(), "te::bulk_allocate: dtypes[", index, "] = \"", name,
      "\" is not a dtype name (expected e.g. \"float32\")");
  TORCH_CHECK_VALUE(
      !c10::isQIntType(it->second), "te::bulk_allocate: dtypes[", index, "] = \"", name,
      "\": quantized dtypes are not supported");
  return it->second;
}

// Deleter of a carved-out tensor's DataPtr: drops its reference to the shared buffer.
void release_buffer(void* buffer_storage) {
  delete static_cast<c10::Storage*>(buffer_storage);
}

}  // namespace

std::vector<at::Tensor> bulk_allocate(
    c10::SymIntArrayRef dims,
    at::IntArrayRef ranks,
    at::ArrayRef<std::string> dtype_names,
    at::Device device,
    at::IntArrayRef alignments,
    bool zero) {
  const size_t n = ranks.size();
  TORCH_CHECK_VALUE(
      dtype_names.size() == n && alignments.size() == n,
      "te::bulk_allocate: ranks, dtypes and alignments need one entry per tensor, got lengths ",
      n, ", ", dtype_names.size(), " and ", alignments.size());

  // Pass 1: validate and lay out. offsets[i] is relative to a base aligned to max_alignment;
  // -1 marks a zero-byte tensor, which is not placed in the buffer.
  std::vector<std::vector<int64_t>> shapes(n);
  std::vector<at::ScalarType> dtypes(n);
  std::vector<int64_t> offsets(n, -1);
  uint64_t size = 0;
  uint64_t max_alignment = 1;
  size_t next_dim = 0;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(
        ranks[i] >= 0 && next_dim + static_cast<size_t>(ranks[i]) <= dims.size(),
        "te::bulk_allocate: ranks[", i, "] = ", ranks[i], " is negative or runs past the ",
        dims.size(), " entries of dims");
    std::vector<int64_t>& shape = shapes[i];
    shape.reserve(ranks[i]);
    for (int64_t d = 0; d < ranks[i]; ++d) {
      const int64_t dim = dims[next_dim++].guard_int(__FILE__, __LINE__);
      TORCH_CHECK_VALUE(
          dim >= 0, "te::bulk_allocate: tensor ", i, " has negative dimension ", dim);
      shape.push_back(dim);
    }
    TORCH_CHECK_VALUE(
        is_power_of_two(alignments[i]) && static_cast<uint64_t>(alignments[i]) <= kMaxBytes,
        "te::bulk_allocate: alignments[", i, "] must be a positive power of two, got ",
        alignments[i]);

    dtypes[i] = dtype_from_name(dtype_names[i], i);
    const uint64_t itemsize = c10::elementSize(dtypes[i]);
    uint64_t nbytes = 0;
    const bool overflow = c10::safe_multiplies_u64(shape, &nbytes) ||
        c10::mul_overflows(nbytes, itemsize, &nbytes);
    TORCH_CHECK_VALUE(
        !overflow && nbytes <= kMaxBytes, "te::bulk_allocate: tensor ", i, " is too large");
    if (nbytes == 0) {
      continue;
    }
    const uint64_t alignment = std::max<uint64_t>(alignments[i], itemsize);
    size = align_up(size, alignment);
    offsets[i] = static_cast<int64_t>(size);
    size += nbytes;
    TORCH_CHECK_VALUE(size <= kMaxBytes, "te::bulk_allocate: total size is too large");
    max_alignment = std::max(max_alignment, alignment);
  }
  TORCH_CHECK_VALUE(
      next_dim == dims.size(), "te::bulk_allocate: ranks sum to ", next_dim, " but dims has ",
      dims.size(), " entries");

  std::vector<at::Tensor> out;
  out.reserve(n);
  const auto options = at::TensorOptions().device(device);
  if (size == 0 || device.is_meta()) {
    // Nothing to share (or no memory at all, on meta): plain allocations.
    for (size_t i = 0; i < n; ++i) {
      const auto tensor_options = options.dtype(dtypes[i]);
      out.push_back(
          zero ? at::zeros(shapes[i], tensor_options) : at::empty(shapes[i], tensor_options));
    }
    return out;
  }

  // Pass 2: one allocation, then a tensor per non-empty spec pointing into it.
  const at::Tensor buffer = at::empty(
      {static_cast<int64_t>(size + max_alignment - 1)}, options.dtype(at::kByte));
  if (zero) {
    buffer.zero_();
  }
  auto* raw = static_cast<uint8_t*>(buffer.data_ptr());
  const auto raw_address = reinterpret_cast<uintptr_t>(raw);
  uint8_t* base = raw + (align_up(raw_address, max_alignment) - raw_address);
  // The buffer's device always has an index, also when `device` was given as plain "cuda".
  const at::Device buffer_device = buffer.device();
  for (size_t i = 0; i < n; ++i) {
    const auto tensor_options = options.device(buffer_device).dtype(dtypes[i]);
    if (offsets[i] < 0) {
      out.push_back(at::empty(shapes[i], tensor_options));
      continue;
    }
    out.push_back(at::for_blob(base + offsets[i], shapes[i])
                      .context(new c10::Storage(buffer.storage()), &release_buffer)
                      .target_device(buffer_device)
                      .options(tensor_options)
                      .make_tensor());
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(te, m) {
  m.def(
      "bulk_allocate(SymInt[] dims, int[] ranks, str[] dtypes, Device device, "
      "int[] alignments, bool zero=False) -> Tensor[]");
}

// The op has no tensor inputs, so no backend key can be taken from its arguments; a
// CompositeExplicitAutograd kernel is what the dispatcher runs for such a call (the device is
// an argument, and at::empty dispatches on it). Fake tensor mode uses the Python fake impl.
TORCH_LIBRARY_IMPL(te, CompositeExplicitAutograd, m) {
  m.impl("bulk_allocate", &bulk_allocate);
}

}  // namespace te
