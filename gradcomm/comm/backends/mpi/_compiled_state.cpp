// The state the compiled calls share: the MPI functions, the Python classes and names, and the
// steps every call takes (enter, plain, finish). See _compiled_module.cpp.
#include <Python.h>

#include <algorithm>
#include <climits>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Storage.h>

#include "_compiled.h"

namespace gradcomm_mpi {

Mpi mpi{};
Handle sum_op = 0;
Handle byte_type = 0;
Handle datatypes[static_cast<int>(c10::ScalarType::NumOptions)] = {};
Types types;
OpSlots op_slots{};
WorkSlots work_slots{};
PyObject *s_closed, *s_cached_checks, *s_profiler, *s_inflight, *s_adapter, *s_stalls,
    *s_stalled, *s_plain_kinds, *s_seq, *s_p2p_seq, *s_timeout, *s_stall_note, *s_work_timeout,
    *s_description, *s_target, *s_request, *s_keepalive, *s_on_timeout, *s_opname, *s_numel,
    *s_tail, *s_extra, *s_label, *s_text, *s_root, *s_splits, *s_empty, *s_all_reduce,
    *s_reduce_scatter, *s_all_gather, *s_all_to_all, *s_broadcast, *s_reduce, *s_gather,
    *s_scatter, *s_send, *s_recv, *s_finish, *s_batch_isend_irecv, *s_compiled, *empty_tuple;
PyTypeObject calls_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* mpi_error(const char* call, int code) {
  char text[kMaxErrorString + 1] = {};
  int len = 0;
  if (mpi.Error_string(code, text, &len) != 0) len = 0;
  text[std::clamp(len, 0, kMaxErrorString)] = '\0';
  PyErr_Format(PyExc_RuntimeError, "%s: %s", call, text);
  return nullptr;
}


// 1 when the communicator's state lets a call take this path, as IssuePath._fast_tail asks (open,
// debug OFF with the base checks and more than one rank, no profiler, no stall), with nothing
// pending (the Python path drives pending works first) and no device adapter; 0 when not; -1
// with an error set.
//
// The attributes are read from the communicator's __dict__, where its constructor puts them (one
// that is missing there declines the call).
int enter(const Calls* self, Context* ctx) {
  PyObject* owner = PyWeakref_GetObject(self->owner);
  if (owner == nullptr) return -1;
  if (owner == Py_None) return 0;
  Ref dict(PyObject_GenericGetDict(owner, nullptr));
  if (dict.p == nullptr) return -1;
  const struct {
    PyObject* name;
    int want;  // 0: False, 1: True, 2: None, 3: an empty list, 4: a dict (kept)
  } wanted[] = {{s_closed, 0},  {s_cached_checks, 1}, {s_profiler, 2},
                {s_inflight, 3}, {s_adapter, 2},       {s_plain_kinds, 4}};
  for (const auto& w : wanted) {
    PyObject* v = PyDict_GetItemWithError(dict.p, w.name);  // borrowed
    if (v == nullptr) return PyErr_Occurred() ? -1 : 0;
    const bool ok = w.want == 0   ? v == Py_False
                    : w.want == 1 ? v == Py_True
                    : w.want == 2 ? v == Py_None
                    : w.want == 3 ? PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0
                                  : PyDict_CheckExact(v);
    if (!ok) return 0;
    if (w.want == 4) ctx->kinds = Py_NewRef(v);
  }
  PyObject* stalls = PyDict_GetItemWithError(dict.p, s_stalls);
  if (stalls == nullptr) return PyErr_Occurred() ? -1 : 0;
  Ref stalled(PyObject_GetAttr(stalls, s_stalled));
  if (stalled.p == nullptr) return -1;
  if (stalled.p != Py_None) return 0;
  ctx->owner = owner;
  ctx->dict = Py_NewRef(dict.p);
  return 1;
}

const at::Tensor* plain(const Context& ctx, PyObject* obj, Handle* datatype, PyObject** tail) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage() || t.layout() != c10::kStrided ||
      t.device().type() != c10::DeviceType::CPU || t.is_nested())
    return nullptr;
  const Handle dt = datatypes[static_cast<int>(t.scalar_type())];
  const int64_t n = t.numel();
  if (dt == 0 || n <= 0 || n > INT_MAX || !t.is_contiguous() || t.is_neg() || t.is_conj())
    return nullptr;
  auto* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  *tail = PyDict_GetItemWithError(ctx.kinds, dtype);
  if (*tail == nullptr) {
    PyErr_Clear();  // a dtype whose tail is not cached: declined
    return nullptr;
  }
  *datatype = dt;
  return &t;
}

bool disjoint(const at::Tensor& a, const at::Tensor& b) {
  auto pa = reinterpret_cast<uintptr_t>(a.const_data_ptr());
  auto pb = reinterpret_cast<uintptr_t>(b.const_data_ptr());
  return pa + a.nbytes() <= pb || pb + b.nbytes() <= pa;
}

// The rank when obj is exactly an int in [0, size), else -1.
int rank_of(PyObject* obj, int size) {
  if (!PyLong_CheckExact(obj)) return -1;
  const long r = PyLong_AsLong(obj);
  if (r < 0 || r >= size) {
    PyErr_Clear();
    return -1;
  }
  return static_cast<int>(r);
}

// A Description of the next number of the communicator's counter `counter` (_seq or _p2p_seq).
PyObject* describe(PyObject* owner, PyObject* counter, PyObject* opname, int64_t numel,
                   PyObject* tail, PyObject* extra, PyObject* label, PyObject* root) {
  Ref iter(PyObject_GetAttr(owner, counter));
  if (iter.p == nullptr) return nullptr;
  Ref seq(PyIter_Next(iter.p));
  Ref count(PyLong_FromLongLong(numel));
  if (seq.p == nullptr || count.p == nullptr) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(types.description);
  PyObject* desc = type->tp_alloc(type, 0);
  if (desc == nullptr) return nullptr;
  const struct {
    PyObject* name;
    PyObject* value;
  } slots[] = {{s_opname, opname}, {s_seq, seq.p},   {s_numel, count.p},
               {s_tail, tail},     {s_extra, extra}, {s_label, label},
               {s_text, Py_None},  {s_root, root},   {s_splits, Py_None}};
  for (const auto& slot : slots) {
    if (PyObject_SetAttr(desc, slot.name, slot.value) < 0) {
      Py_DECREF(desc);
      return nullptr;
    }
  }
  return desc;
}

namespace {

// A completed collective's CompletedWork, described as the Python path describes it and bound
// to target (None: none).
PyObject* completed(const Context& ctx, PyObject* opname, int64_t numel, PyObject* tail,
                    PyObject* extra, PyObject* label, PyObject* root, PyObject* target) {
  Ref desc(describe(ctx.owner, s_seq, opname, numel, tail, extra, label, root));
  if (desc.p == nullptr) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(types.completed_work);
  PyObject* work = PyBaseObject_Type.tp_new(type, empty_tuple, nullptr);  // class defaults: done
  if (work == nullptr) return nullptr;
  if (PyObject_SetAttr(work, s_description, desc.p) < 0 ||
      (target != Py_None && PyObject_SetAttr(work, s_target, target) < 0))
    Py_CLEAR(work);
  return work;
}

}  // namespace

PyObject* keepalive(const Held* held, int n) {
  Ref keep(PyTuple_New(2 * n));
  if (keep.p == nullptr) return nullptr;
  for (int i = 0; i < n; ++i) {
    PyObject* storage = nullptr;
    try {
      storage = THPStorage_Wrap(held[i].t->storage());
    } catch (...) {
      PyErr_SetString(PyExc_RuntimeError, "gradcomm: could not wrap a tensor's storage");
      return nullptr;
    }
    PyTuple_SET_ITEM(keep.p, i, Py_NewRef(held[i].obj));
    PyTuple_SET_ITEM(keep.p, n + i, storage);
  }
  return Py_NewRef(keep.p);
}

PyObject* pending_work(const Context& ctx, PyObject* desc, Handle request, const Held* held,
                       int n, PyObject* target) {
  Ref handle(PyLong_FromUnsignedLongLong(
      static_cast<unsigned long long>(static_cast<long long>(request))));
  if (handle.p == nullptr) return nullptr;
  Ref req(PyObject_CallOneArg(types.fromhandle, handle.p));
  Ref keep(req.p == nullptr ? nullptr : keepalive(held, n));
  if (keep.p == nullptr) return nullptr;
  Ref inflight(PyObject_GetAttr(ctx.owner, s_inflight));
  Ref timeout(PyObject_GetAttr(ctx.owner, s_timeout));
  Ref stall_note(PyObject_GetAttr(ctx.owner, s_stall_note));
  if (inflight.p == nullptr || timeout.p == nullptr || stall_note.p == nullptr) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(types.mpi_work);
  Ref work(PyBaseObject_Type.tp_new(type, empty_tuple, nullptr));
  if (work.p == nullptr) return nullptr;
  const struct {
    PyObject* name;
    PyObject* value;
  } attrs[] = {{s_description, desc},    {s_work_timeout, timeout.p}, {s_request, req.p},
               {s_keepalive, keep.p},    {s_inflight, inflight.p},    {s_on_timeout, stall_note.p}};
  for (const auto& a : attrs)
    if (PyObject_SetAttr(work.p, a.name, a.value) < 0) return nullptr;
  if (target != Py_None && PyObject_SetAttr(work.p, s_target, target) < 0) return nullptr;
  if (PyList_Append(inflight.p, work.p) < 0) return nullptr;
  return Py_NewRef(work.p);
}

PyObject* finish(const Calls* self, const Context& ctx, const Said& said, PyObject* target,
                 const char* call, int err, Handle request, Held a, Held b) {
  if (err != 0) return mpi_error(call, err);
  const c10::Storage hold_a = a.t->storage();
  const c10::Storage hold_b = b.t == nullptr ? c10::Storage() : b.t->storage();
  const int flag = poll(&request, kStatusIgnore, self->budget, false, &err);
  if (err != 0) return mpi_error(call, err);
  Ref root(said.root < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(said.root));
  if (root.p == nullptr) return nullptr;
  if (flag != 0)
    return completed(ctx, said.opname, said.numel, said.tail, said.extra, said.label, root.p,
                     target);
  Ref desc(describe(ctx.owner, s_seq, said.opname, said.numel, said.tail, said.extra, said.label,
                    root.p));
  if (desc.p == nullptr) return nullptr;
  const Held held[] = {a, b};
  return pending_work(ctx, desc.p, request, held, b.obj == nullptr ? 1 : 2, target);
}

bool arity(Py_ssize_t got, Py_ssize_t want, const char* name) {
  if (got == want) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, got);
  return false;
}

// "src=3" or "dst=3", as the Python path's descriptions say (a new reference).
PyObject* root_text(const Calls* self, bool src, int root) {
  return Py_NewRef(PyTuple_GET_ITEM(src ? self->src_texts : self->dst_texts, root));
}

}  // namespace gradcomm_mpi
