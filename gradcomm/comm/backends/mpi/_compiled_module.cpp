// The MPI communicator's common calls in one compiled call each: blocking collectives of plain
// CPU tensors (the tensor checks, the post of the non-blocking MPI collective and the Test()
// poll) and batch_isend_irecv (the checks, the posts and the pending works). Built and loaded by
// compiled.py, which documents when it is used; a call it declines returns None and takes the
// Python path, which raises what it raises.
//
// MPI is not linked at build time: the functions are looked up in the libmpi that mpi4py already
// loaded (dlopen with RTLD_NOLOAD), and the handles are those of the MPICH ABI (MPICH >= 3.1 and
// its derivatives: Intel MPI, MVAPICH, Cray MPICH), in which every handle is an int. compiled.py
// checks that mpi4py runs on that ABI before it binds this module.
//
// The works and descriptions made here carry the attributes that MPIWork.__init__, Work.bind,
// CompletedWork and Description.__init__ set (tests/comm/test_mpi_compiled.py compares them).
//
// Sources: _compiled.h (shared declarations), _compiled_state.cpp (the steps every call takes),
// _compiled_collectives.cpp, _compiled_transfers.cpp, and this file (the Calls type and the
// module's set-up functions).
#include <Python.h>

#include <dlfcn.h>

#include <algorithm>
#include <iterator>

#include <torch/csrc/Dtype.h>

#include "_compiled.h"

namespace gradcomm_mpi {
namespace {

bool bound = false;  // bind() ran
bool typed = false;  // set_types() ran

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)), METH_FASTCALL

PyMethodDef calls_methods[] = {
    {"all_reduce", FASTCALL(all_reduce), "all_reduce(tensor, label): SUM in place"},
    {"reduce_scatter", FASTCALL(reduce_scatter), "reduce_scatter(output, input, label): SUM"},
    {"all_gather", FASTCALL(all_gather), "all_gather(output, input)"},
    {"all_to_all", FASTCALL(all_to_all), "all_to_all(output, input): equal splits"},
    {"broadcast", FASTCALL(broadcast), "broadcast(tensor, src)"},
    {"reduce", FASTCALL(reduce), "reduce(tensor, dst): SUM"},
    {"gather", FASTCALL(gather), "gather(output or None, input, dst)"},
    {"scatter", FASTCALL(scatter), "scatter(output, input or None, src)"},
    {"batch", FASTCALL(batch), "batch(ops): post a list of P2POp, return their works"},
    {nullptr, nullptr, 0, nullptr}};

bool handle_of(PyObject* obj, Handle* out) {
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj);  // mpi4py sign-extends handles
  if (PyErr_Occurred()) return false;
  *out = static_cast<Handle>(static_cast<uint32_t>(v));
  return true;
}

PyObject* calls_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *owner = nullptr, *comm_obj = nullptr;
  int size = 0, rank = 0;
  double budget = 0.0;
  static const char* names[] = {"owner", "comm", "size", "rank", "budget", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOiid", const_cast<char**>(names), &owner,
                                   &comm_obj, &size, &rank, &budget))
    return nullptr;
  if (!bound || !typed) {
    PyErr_SetString(PyExc_RuntimeError, "call bind(), set_datatypes() and set_types() first");
    return nullptr;
  }
  if (size < 2 || rank < 0 || rank >= size || !(budget > 0.0)) {
    PyErr_SetString(PyExc_ValueError, "need size >= 2, 0 <= rank < size and budget > 0");
    return nullptr;
  }
  Handle comm = 0;
  if (!handle_of(comm_obj, &comm)) return nullptr;
  auto* self = reinterpret_cast<Calls*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->owner = PyWeakref_NewRef(owner, nullptr);
  self->src_texts = PyTuple_New(size);
  self->dst_texts = PyTuple_New(size);
  bool ok = self->owner != nullptr && self->src_texts != nullptr && self->dst_texts != nullptr;
  for (int r = 0; ok && r < size; ++r) {
    PyObject* src = PyUnicode_FromFormat("src=%d", r);
    PyObject* dst = PyUnicode_FromFormat("dst=%d", r);
    ok = src != nullptr && dst != nullptr;
    if (src != nullptr) PyTuple_SET_ITEM(self->src_texts, r, src);
    if (dst != nullptr) PyTuple_SET_ITEM(self->dst_texts, r, dst);
  }
  if (!ok) {
    Py_DECREF(self);
    return nullptr;
  }
  self->comm = comm;
  self->size = size;
  self->rank = rank;
  self->budget = budget;
  return reinterpret_cast<PyObject*>(self);
}

void calls_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<Calls*>(obj);
  Py_CLEAR(self->owner);
  Py_CLEAR(self->src_texts);
  Py_CLEAR(self->dst_texts);
  Py_TYPE(obj)->tp_free(obj);
}

PyTypeObject calls_type = {PyVarObject_HEAD_INIT(nullptr, 0)};

// ---------------------------------------------------------------- module functions

// bind(library, sum_op, byte_type): look the MPI functions up in the already loaded `library`
// (e.g. "libmpi.so.12"); MPI_SUM's and MPI_BYTE's handles as mpi4py gives them.
PyObject* bind(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "bind")) return nullptr;
  const char* name = PyUnicode_AsUTF8(args[0]);
  Handle sum = 0, byte = 0;
  if (name == nullptr || !handle_of(args[1], &sum) || !handle_of(args[2], &byte)) return nullptr;
  void* lib = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) {
    PyErr_Format(PyExc_OSError, "%s is not loaded in this process", name);
    return nullptr;
  }
  Mpi found{};
  const struct {
    const char* symbol;
    void** slot;
  } table[] = {
      {"MPI_Iallreduce", reinterpret_cast<void**>(&found.Iallreduce)},
      {"MPI_Ireduce_scatter_block", reinterpret_cast<void**>(&found.Ireduce_scatter_block)},
      {"MPI_Iallgather", reinterpret_cast<void**>(&found.Iallgather)},
      {"MPI_Ialltoall", reinterpret_cast<void**>(&found.Ialltoall)},
      {"MPI_Ibcast", reinterpret_cast<void**>(&found.Ibcast)},
      {"MPI_Ireduce", reinterpret_cast<void**>(&found.Ireduce)},
      {"MPI_Igather", reinterpret_cast<void**>(&found.Igather)},
      {"MPI_Iscatter", reinterpret_cast<void**>(&found.Iscatter)},
      {"MPI_Isend", reinterpret_cast<void**>(&found.Isend)},
      {"MPI_Irecv", reinterpret_cast<void**>(&found.Irecv)},
      {"MPI_Test", reinterpret_cast<void**>(&found.Test)},
      {"MPI_Error_string", reinterpret_cast<void**>(&found.Error_string)},
  };
  for (const auto& entry : table) {
    *entry.slot = dlsym(lib, entry.symbol);
    if (*entry.slot == nullptr) {
      dlclose(lib);
      PyErr_Format(PyExc_OSError, "%s has no %s", name, entry.symbol);
      return nullptr;
    }
  }
  // this reference keeps the library loaded for the process's life (mpi4py holds it anyway)
  mpi = found;
  sum_op = sum;
  byte_type = byte;
  bound = true;
  Py_RETURN_NONE;
}

// set_datatypes({torch.dtype: MPI datatype handle}): the dtypes these calls take.
PyObject* set_datatypes(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 1, "set_datatypes")) return nullptr;
  if (!PyDict_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "set_datatypes takes a dict");
    return nullptr;
  }
  Handle table[static_cast<int>(c10::ScalarType::NumOptions)] = {};
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(args[0], &pos, &key, &value)) {
    if (!THPDtype_Check(key)) {
      PyErr_SetString(PyExc_TypeError, "set_datatypes: keys must be torch dtypes");
      return nullptr;
    }
    const int index = static_cast<int>(reinterpret_cast<THPDtype*>(key)->scalar_type);
    if (!handle_of(value, &table[index])) return nullptr;
  }
  std::copy(std::begin(table), std::end(table), std::begin(datatypes));
  Py_RETURN_NONE;
}

// set_types(CompletedWork, MPIWork, Description, P2POp, P2PKind.SEND, P2PKind.RECV,
//           ReduceOp.SUM, MPI.Request.fromhandle, MPI.Status, tag_limit)
PyObject* set_types(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 10, "set_types")) return nullptr;
  for (int i = 0; i < 4; ++i) {
    if (!PyType_Check(args[i])) {
      PyErr_SetString(PyExc_TypeError, "set_types: the first four arguments are classes");
      return nullptr;
    }
  }
  const long limit = PyLong_AsLong(args[9]);
  if (limit == -1 && PyErr_Occurred()) return nullptr;
  PyObject** slots[] = {&types.completed_work, &types.mpi_work,  &types.description,
                        &types.p2pop,          &types.send_kind, &types.recv_kind,
                        &types.sum,            &types.fromhandle, &types.status};
  for (int i = 0; i < 9; ++i) Py_XSETREF(*slots[i], Py_NewRef(args[i]));
  types.tag_limit = limit;
  typed = true;
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"bind", FASTCALL(bind), "bind(library, sum_op, byte_type): find the MPI functions"},
    {"set_datatypes", FASTCALL(set_datatypes), "set_datatypes({dtype: MPI datatype handle})"},
    {"set_types", FASTCALL(set_types),
     "set_types(CompletedWork, MPIWork, Description, P2POp, SEND, RECV, SUM, fromhandle, "
     "Status, tag_limit)"},
    {nullptr, nullptr, 0, nullptr}};

#define GRADCOMM_STR2(x) #x
#define GRADCOMM_STR(x) GRADCOMM_STR2(x)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, GRADCOMM_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                          module_methods};

bool intern_names() {
  const struct {
    PyObject** slot;
    const char* text;
  } names[] = {
      {&s_closed, "_closed"}, {&s_cached_checks, "_cached_checks"}, {&s_profiler, "profiler"},
      {&s_inflight, "_inflight"}, {&s_adapter, "_adapter"}, {&s_stalls, "_stalls"},
      {&s_stalled, "stalled"}, {&s_plain_kinds, "_plain_kinds"}, {&s_seq, "_seq"},
      {&s_p2p_seq, "_p2p_seq"}, {&s_timeout, "_timeout"}, {&s_stall_note, "_stall_note"},
      {&s_work_timeout, "timeout"}, {&s_description, "_description"}, {&s_target, "_target"},
      {&s_request, "_request"}, {&s_expect_bytes, "_expect_bytes"}, {&s_status, "_status"},
      {&s_keepalive, "_keepalive"}, {&s_on_timeout, "_on_timeout"}, {&s_opname, "_opname"},
      {&s_numel, "_numel"}, {&s_tail, "_tail"}, {&s_extra, "_extra"}, {&s_label, "_label"},
      {&s_text, "_text"}, {&s_root, "root"}, {&s_splits, "splits"}, {&s_empty, ""},
      {&s_all_reduce, "all_reduce"}, {&s_reduce_scatter, "reduce_scatter"},
      {&s_all_gather, "all_gather"}, {&s_all_to_all, "all_to_all"},
      {&s_broadcast, "broadcast"}, {&s_reduce, "reduce"}, {&s_gather, "gather"},
      {&s_scatter, "scatter"}, {&s_send, "send"}, {&s_recv, "recv"},
  };
  for (const auto& name : names)
    if ((*name.slot = PyUnicode_InternFromString(name.text)) == nullptr) return false;
  return (empty_tuple = PyTuple_New(0)) != nullptr;
}


// The module: the Calls type and the set-up functions.
PyObject* init_module() {
  calls_type.tp_name = "gradcomm_mpi_compiled.Calls";
  calls_type.tp_basicsize = sizeof(Calls);
  calls_type.tp_flags = Py_TPFLAGS_DEFAULT;
  calls_type.tp_doc = "Calls(owner, comm, size, rank, budget): one communicator's calls";
  calls_type.tp_new = calls_new;
  calls_type.tp_dealloc = calls_dealloc;
  calls_type.tp_methods = calls_methods;
  if (PyType_Ready(&calls_type) < 0 || !intern_names()) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (PyModule_AddObject(m, "Calls", Py_NewRef(reinterpret_cast<PyObject*>(&calls_type))) < 0) {
    Py_DECREF(&calls_type);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}

}  // namespace
}  // namespace gradcomm_mpi

#define GRADCOMM_CONCAT2(a, b) a##b
#define GRADCOMM_CONCAT(a, b) GRADCOMM_CONCAT2(a, b)

PyMODINIT_FUNC GRADCOMM_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  return gradcomm_mpi::init_module();
}
