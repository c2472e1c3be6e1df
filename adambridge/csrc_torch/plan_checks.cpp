// The facts a cached step plan checks each step, read in one native pass per kind.
//
// The plain-C kernel (csrc/) never sees a torch object: Python hands it raw pointers. A plan
// over thousands of parameters must still confirm, every step, that each parameter, gradient
// and state tensor is the one whose pointer its row holds. In Python that is about ten passes
// over 10,000 tensors, each waiting for cold metadata, ~2 us a parameter. Here each pass walks
// the objects in chunks, prefetching the next level of pointers for the whole chunk before it
// reads any of them, so the cache misses of a chunk overlap.
//
// Every entry point holds the GIL (the loader declares them with PYFUNCTYPE), catches every
// C++ exception (a tensor without storage, an inference tensor's version counter) and answers
// with a plain code: -1 = all match, i >= 0 = the first row that does not (the caller then
// takes the full path, which says what is wrong), AB_FACTS_FAILED = something threw.
// Nothing here raises into Python and nothing is written unless the function says so.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

#define AB_FACTS_ABI 1
#define AB_FACTS_FAILED (-2)
#define AB_ROW_WORDS 12   // ptr, dtype, dim, sizes[AB_MAX_DIM], scratch
#define AB_MAX_DIM 8
#define AB_CHUNK 32       // rows whose pointers are prefetched together
#define AB_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using std::int64_t;

inline void prefetch(const void* p) { __builtin_prefetch(p); }

// The cache lines of a TensorImpl that data(), sizes(), dtype and the flags read (its first
// 256 bytes), or (only_data) the two that data() reads: the storage and then the offset,
// element count and dtype. A line too many costs nothing but bandwidth, one too few a wait.
inline void prefetch_impl(const c10::TensorImpl* impl, bool only_data = false) {
  const char* p = reinterpret_cast<const char*>(impl);
  prefetch(p);
  prefetch(p + 128);
  if (!only_data) {
    prefetch(p + 64);
    prefetch(p + 192);
  }
}

inline c10::TensorImpl* impl_of(PyObject* obj) {
  return THPVariable_Unpack(obj).unsafeGetTensorImpl();
}

// A dense CPU tensor with storage of its own, read by a C kernel as a flat array: anything
// else (a subclass dispatching to Python, a lazily negated view, a wrapper without storage)
// is not for a plan.
inline bool plain(const c10::TensorImpl* impl) {
  return impl->layout() == c10::kStrided && impl->device_type() == c10::DeviceType::CPU &&
         impl->has_storage() && !impl->is_neg() && !impl->is_conj() &&
         !impl->key_set().has(c10::DispatchKey::Python) && impl->is_contiguous();
}

inline bool same_layout(const c10::TensorImpl* impl, const int64_t* row) {
  if (static_cast<int64_t>(c10::typeMetaToScalarType(impl->dtype())) != row[1]) return false;
  c10::IntArrayRef sizes = impl->sizes();
  if (static_cast<int64_t>(sizes.size()) != row[2]) return false;
  for (size_t d = 0; d < sizes.size(); d++)
    if (sizes[d] != row[3 + d]) return false;
  return true;
}

inline int64_t address(const c10::TensorImpl* impl) {
  return reinterpret_cast<int64_t>(impl->data());
}

inline void prefetch_storage(const c10::TensorImpl* impl) {
  if (impl->has_storage()) prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
}

// The TensorImpls of list[start:end] (of tensors, or of their gradients), each level of
// pointers prefetched for the whole chunk before it is followed. A missing gradient is null.
Py_ssize_t chunk_impls(PyObject* list, Py_ssize_t start, Py_ssize_t end, bool grads,
                       c10::TensorImpl** out) {
  for (Py_ssize_t i = start; i < end; i++) prefetch(PyList_GET_ITEM(list, i));
  for (Py_ssize_t i = start; i < end; i++) prefetch_impl(impl_of(PyList_GET_ITEM(list, i)));
  if (grads) {
    for (Py_ssize_t i = start; i < end; i++) {
      const at::Tensor& grad = THPVariable_Unpack(PyList_GET_ITEM(list, i)).grad();
      out[i - start] = grad.defined() ? grad.unsafeGetTensorImpl() : nullptr;
      if (out[i - start]) prefetch_impl(out[i - start]);
    }
  } else {
    for (Py_ssize_t i = start; i < end; i++) out[i - start] = impl_of(PyList_GET_ITEM(list, i));
  }
  for (Py_ssize_t i = start; i < end; i++)
    if (out[i - start]) prefetch_storage(out[i - start]);
  return end - start;
}

// Walk list's TensorImpls (or its gradients') chunk by chunk, calling ok(impl, i) for each
// (impl null for a missing gradient): -1 when every call says true, else the first i that
// does not, AB_FACTS_FAILED when something throws.
template <typename Ok>
int64_t first_unfit(PyObject* list, bool grads, Ok ok) {
  try {
    c10::TensorImpl* impls[AB_CHUNK];
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t s = 0; s < n; s += AB_CHUNK) {
      Py_ssize_t count = chunk_impls(list, s, s + AB_CHUNK < n ? s + AB_CHUNK : n, grads, impls);
      for (Py_ssize_t k = 0; k < count; k++)
        if (!ok(impls[k], s + k)) return s + k;
    }
    return -1;
  } catch (...) {
    return AB_FACTS_FAILED;
  }
}

}  // namespace

AB_EXPORT int ab_facts_abi(void) { return AB_FACTS_ABI; }

// Fill rows (len(list) x AB_ROW_WORDS int64) with each tensor's (or, grads != 0, its
// gradient's) pointer, dtype code and sizes. -1, or the first row a plan cannot hold.
AB_EXPORT int64_t ab_read_rows(PyObject* list, int64_t* rows, int grads) {
  return first_unfit(list, grads != 0, [rows](const c10::TensorImpl* impl, Py_ssize_t i) {
    if (!impl || !plain(impl) || impl->dim() > AB_MAX_DIM) return false;
    int64_t* row = rows + i * AB_ROW_WORDS;
    row[0] = address(impl);
    row[1] = static_cast<int64_t>(c10::typeMetaToScalarType(impl->dtype()));
    row[2] = impl->dim();
    for (int64_t d = 0; d < impl->dim(); d++) row[3 + d] = impl->sizes()[d];
    return true;
  });
}

// Whether each tensor of list still is a plain tensor with its row's pointer, dtype and sizes.
AB_EXPORT int64_t ab_check_rows(PyObject* list, const int64_t* rows) {
  return first_unfit(list, false, [rows](const c10::TensorImpl* impl, Py_ssize_t i) {
    const int64_t* row = rows + i * AB_ROW_WORDS;
    return plain(impl) && address(impl) == row[0] && same_layout(impl, row);
  });
}

// The gradients of params: each must be a plain tensor with its row's dtype and sizes (the
// row's pointer is not compared: a new gradient tensor each step is the common case). When
// all are, each pointer goes into its row and into the descriptor column (column +
// i * stride_bytes), and -1 is returned; otherwise nothing but the rows' scratch words is
// written.
AB_EXPORT int64_t ab_take_grads(PyObject* params, int64_t* rows, char* column,
                                int64_t stride_bytes) {
  int64_t found = first_unfit(params, true, [rows](const c10::TensorImpl* impl, Py_ssize_t i) {
    int64_t* row = rows + i * AB_ROW_WORDS;
    if (!impl || !plain(impl) || !same_layout(impl, row)) return false;
    row[AB_ROW_WORDS - 1] = address(impl);  // the scratch word holds it until all pass
    return true;
  });
  if (found != -1) return found;
  // Every gradient passed: the pointers go in from the rows (the tensors are cold again).
  for (Py_ssize_t i = 0, n = PyList_GET_SIZE(params); i < n; i++) {
    int64_t* row = rows + i * AB_ROW_WORDS;
    row[0] = row[AB_ROW_WORDS - 1];
    *reinterpret_cast<int64_t*>(column + i * stride_bytes) = row[0];
  }
  return -1;
}

// Each dict of dicts must map keys[j] to the very object refs[i * nkeys + j] (an address), and
// its last ntensors values must still have the storage ptrs[i * ntensors + t] (t.data = ...
// keeps the object). A missing key is a mismatch.
AB_EXPORT int64_t ab_check_states(PyObject* dicts, PyObject* keys, const int64_t* refs,
                                  const int64_t* ptrs, int64_t ntensors) {
  try {
    Py_ssize_t n = PyList_GET_SIZE(dicts), nkeys = PyTuple_GET_SIZE(keys);
    if (ntensors > nkeys || nkeys > 8) return AB_FACTS_FAILED;
    Py_ssize_t first = nkeys - ntensors;
    PyObject* values[AB_CHUNK][8];
    c10::TensorImpl* impls[AB_CHUNK][8];
    for (Py_ssize_t s = 0; s < n; s += AB_CHUNK) {
      Py_ssize_t count = (s + AB_CHUNK < n ? s + AB_CHUNK : n) - s;
      for (Py_ssize_t k = 0; k < count; k++) prefetch(PyList_GET_ITEM(dicts, s + k));
      for (Py_ssize_t k = 0; k < count; k++) {
        // The keys table: its header, index and first entries (public struct field).
        const char* table = reinterpret_cast<const char*>(
            reinterpret_cast<PyDictObject*>(PyList_GET_ITEM(dicts, s + k))->ma_keys);
        prefetch(table);
        prefetch(table + 64);
      }
      for (Py_ssize_t k = 0; k < count; k++) {
        PyObject* dict = PyList_GET_ITEM(dicts, s + k);
        const int64_t* expected = refs + (s + k) * nkeys;
        for (Py_ssize_t j = 0; j < nkeys; j++) {
          PyObject* value = PyDict_GetItem(dict, PyTuple_GET_ITEM(keys, j));  // borrowed
          if (reinterpret_cast<int64_t>(value) != expected[j]) return s + k;
          values[k][j] = value;
          if (j >= first) prefetch(value);
        }
      }
      // The values are the plan's own tensor objects (compared by address above).
      for (Py_ssize_t k = 0; k < count; k++)
        for (Py_ssize_t j = first; j < nkeys; j++) {
          impls[k][j] = impl_of(values[k][j]);
          prefetch_impl(impls[k][j], true);
        }
      for (Py_ssize_t k = 0; k < count; k++)
        for (Py_ssize_t j = first; j < nkeys; j++) prefetch_storage(impls[k][j]);
      for (Py_ssize_t k = 0; k < count; k++)
        for (Py_ssize_t j = first; j < nkeys; j++)
          if (!impls[k][j]->has_storage() ||
              address(impls[k][j]) != ptrs[(s + k) * ntensors + (j - first)])
            return s + k;
    }
    return -1;
  } catch (...) {
    return AB_FACTS_FAILED;
  }
}

// Whether lists (a list of lists) holds, in order, the objects at addresses[0:n], and no more.
AB_EXPORT int64_t ab_same_items(PyObject* lists, const int64_t* addresses, int64_t n) {
  int64_t at = 0;
  for (Py_ssize_t g = 0, groups = PyList_GET_SIZE(lists); g < groups; g++) {
    PyObject* list = PyList_GET_ITEM(lists, g);
    if (!PyList_Check(list)) return 0;
    Py_ssize_t count = PyList_GET_SIZE(list);
    if (at + count > n) return 0;
    for (Py_ssize_t i = 0; i < count; i++, at++)
      if (reinterpret_cast<int64_t>(PyList_GET_ITEM(list, i)) != addresses[at]) return 0;
  }
  return at == n;
}

// Whether dict maps, in insertion order, exactly the keys at keys[0:n] to the values at
// values[0:n] (addresses: no key is hashed, no value compared).
AB_EXPORT int64_t ab_same_dict(PyObject* dict, const int64_t* keys, const int64_t* values,
                               int64_t n) {
  if (PyDict_GET_SIZE(dict) != n) return 0;
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    if (reinterpret_cast<int64_t>(key) != keys[i] || reinterpret_cast<int64_t>(value) != values[i])
      return 0;
    i++;
  }
  return i == n;
}

// Bump the autograd version of every tensor of list, as torch.autograd.graph.increment_version
// does, all or (on an error, say an inference tensor) the ones before the failing one.
AB_EXPORT int64_t ab_bump_versions(PyObject* list) {
  Py_ssize_t i = 0;
  try {
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t s = 0; s < n; s += AB_CHUNK) {
      Py_ssize_t end = s + AB_CHUNK < n ? s + AB_CHUNK : n;
      for (Py_ssize_t k = s; k < end; k++) prefetch(PyList_GET_ITEM(list, k));
      for (Py_ssize_t k = s; k < end; k++) prefetch(impl_of(PyList_GET_ITEM(list, k)));
      for (i = s; i < end; i++) impl_of(PyList_GET_ITEM(list, i))->bump_version();
    }
    return -1;
  } catch (...) {
    return i;
  }
}

// versions[i] = the autograd version of list[i].
AB_EXPORT int64_t ab_read_versions(PyObject* list, int64_t* versions) {
  try {
    for (Py_ssize_t i = 0, n = PyList_GET_SIZE(list); i < n; i++)
      versions[i] = impl_of(PyList_GET_ITEM(list, i))->version_counter().current_version();
    return -1;
  } catch (...) {
    return AB_FACTS_FAILED;
  }
}
