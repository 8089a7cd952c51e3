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
// A transfer's work is a TransferWork (compiled.py), whose wait, _wait and _test are compiled.
//
// Sources: _compiled.h (shared declarations), _compiled_state.cpp (the steps every call takes),
// _compiled_collectives.cpp, _compiled_transfers.cpp, _compiled_transfer_work.cpp (the methods of
// a transfer's work), and this file (the Calls type and the module's set-up functions).
#include <Python.h>

#include <dlfcn.h>
#include <structmember.h>

#include <algorithm>
#include <initializer_list>
#include <iterator>
#include <utility>

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

// Texts "<prefix>0 tag=0", "<prefix>1 tag=0", ... into *out (a new tuple of `size`); false with
// an error set.
bool peer_texts(const char* prefix, int size, bool tag, PyObject** out) {
  *out = PyTuple_New(size);
  for (int r = 0; *out != nullptr && r < size; ++r) {
    PyObject* text = PyUnicode_FromFormat(tag ? "%s%d tag=0" : "%s%d", prefix, r);
    if (text == nullptr) return false;
    PyTuple_SET_ITEM(*out, r, text);
  }
  return *out != nullptr;
}

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
  if (self->owner == nullptr || !peer_texts("src=", size, false, &self->src_texts) ||
      !peer_texts("dst=", size, false, &self->dst_texts) ||
      !peer_texts("dst=", size, true, &self->send_texts) ||
      !peer_texts("src=", size, true, &self->recv_texts)) {
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
  Py_CLEAR(self->send_texts);
  Py_CLEAR(self->recv_texts);
  Py_TYPE(obj)->tp_free(obj);
}


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
      {"MPI_Get_count", reinterpret_cast<void**>(&found.Get_count)},
      {"MPI_Error_class", reinterpret_cast<void**>(&found.Error_class)},
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
//           ReduceOp.SUM, MPI.Request.fromhandle, tag_limit, TransferWork, Work.wait,
//           wait_budget, batch_method): TransferWork is the class of batch()'s works (an MPIWork
// subclass whose methods are this module's transfer_*), wait_budget the seconds its wait polls
// before it hands over to Work.wait, batch_method the Python batch_isend_irecv that the
// compiled one stands in for.
// The offsets of `type`'s object slots (its or a base's __slots__), each into its field; false
// with a TypeError when one is not such a slot.
bool slot_offsets(PyObject* type,
                  std::initializer_list<std::pair<const char*, Py_ssize_t*>> fields) {
  for (const auto& [name, out] : fields) {
    Ref found(PyObject_GetAttrString(type, name));  // on a class: the member descriptor itself
    if (found.p == nullptr) return false;
    const auto* descr = reinterpret_cast<PyMemberDescrObject*>(found.p);
    if (!Py_IS_TYPE(found.p, &PyMemberDescr_Type) || descr->d_member->type != T_OBJECT_EX ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), PyDescr_TYPE(found.p))) {
      PyErr_Format(PyExc_TypeError, "set_types: %R.%s is not an object slot", type, name);
      return false;
    }
    *out = descr->d_member->offset;
  }
  return true;
}

PyObject* set_types(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 13, "set_types")) return nullptr;
  for (const int i : {0, 1, 2, 3, 9}) {
    if (!PyType_Check(args[i])) {
      PyErr_SetString(PyExc_TypeError, "set_types: arguments 1-4 and 10 are classes");
      return nullptr;
    }
  }
  const long limit = PyLong_AsLong(args[8]);
  if (limit == -1 && PyErr_Occurred()) return nullptr;
  const double budget = PyFloat_AsDouble(args[11]);
  if ((budget == -1.0 && PyErr_Occurred()) || !set_transfer_work(args[10], budget))
    return nullptr;
  OpSlots ops{};
  WorkSlots w{};
  if (!slot_offsets(args[3], {{"_op", &ops.op},
                              {"_tensor", &ops.tensor},
                              {"_peer", &ops.peer},
                              {"_tag", &ops.tag}}) ||
      !slot_offsets(args[9], {{"_said", &w.said},
                               {"_handle", &w.handle},
                               {"_polling", &w.polling},
                               {"timeout", &w.timeout},
                               {"_keepalive", &w.keepalive},
                               {"_inflight", &w.inflight},
                               {"_on_timeout", &w.on_timeout},
                               {"_target", &w.target},
                               {"_expect_bytes", &w.expect_bytes},
                               {"_done", &w.done},
                               {"_failure", &w.failure},
                               {"_callbacks", &w.callbacks},
                               {"_error", &w.error},
                               {"_running", &w.running}}))
    return nullptr;
  op_slots = ops;
  work_slots = w;
  PyObject** slots[] = {&types.completed_work, &types.mpi_work,  &types.description,
                        &types.p2pop,          &types.send_kind, &types.recv_kind,
                        &types.sum,            &types.fromhandle};
  for (int i = 0; i < 8; ++i) Py_XSETREF(*slots[i], Py_NewRef(args[i]));
  Py_XSETREF(types.transfer_work, Py_NewRef(args[9]));
  Py_XSETREF(types.batch_method, Py_NewRef(args[12]));
  types.tag_limit = limit;
  typed = true;
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"bind", FASTCALL(bind), "bind(library, sum_op, byte_type): find the MPI functions"},
    {"set_datatypes", FASTCALL(set_datatypes), "set_datatypes({dtype: MPI datatype handle})"},
    {"set_types", FASTCALL(set_types),
     "set_types(CompletedWork, MPIWork, Description, P2POp, SEND, RECV, SUM, fromhandle, "
     "tag_limit, TransferWork, Work.wait, wait_budget, batch_method)"},
    {"transfer_test", FASTCALL(transfer_test), "transfer_test(work): a transfer work's _test"},
    {"batch_isend_irecv",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(batch_isend_irecv)),
     METH_FASTCALL | METH_KEYWORDS,
     "batch_isend_irecv($module, comm, /, ops)\n--\n\n"
     "Post a list of P2POp at once and return their works: Communicator.batch_isend_irecv "
     "in compiled code, bound to an MPI communicator (compiled.bind_batch)."},
    {"transfer_wait_for", FASTCALL(transfer_wait_for),
     "transfer_wait_for(work, timeout): a transfer work's _wait"},
    {"transfer_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(transfer_wait)),
     METH_FASTCALL | METH_KEYWORDS, "transfer_wait(work, timeout=None): a transfer work's wait"},
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
      {&s_request, "_request"}, {&s_keepalive, "_keepalive"}, {&s_on_timeout, "_on_timeout"},
      {&s_opname, "_opname"}, {&s_numel, "_numel"}, {&s_tail, "_tail"}, {&s_extra, "_extra"},
      {&s_label, "_label"},
      {&s_text, "_text"}, {&s_root, "root"}, {&s_splits, "splits"}, {&s_empty, ""},
      {&s_all_reduce, "all_reduce"}, {&s_reduce_scatter, "reduce_scatter"},
      {&s_all_gather, "all_gather"}, {&s_all_to_all, "all_to_all"},
      {&s_broadcast, "broadcast"}, {&s_reduce, "reduce"}, {&s_gather, "gather"},
      {&s_scatter, "scatter"}, {&s_send, "send"}, {&s_recv, "recv"}, {&s_finish, "_finish"},
      {&s_batch_isend_irecv, "batch_isend_irecv"}, {&s_compiled, "_compiled"},
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
  // {method name: the transfer_* function as a method} for the class of batch()'s works
  Ref methods(PyDict_New());
  bool ok = methods.p != nullptr;
  const char* const pairs[][2] = {
      {"wait", "transfer_wait"}, {"_wait", "transfer_wait_for"}, {"_test", "transfer_test"}};
  for (const auto& pair : pairs) {
    if (!ok) break;
    Ref function(PyObject_GetAttrString(m, pair[1]));
    Ref method(function.p == nullptr ? nullptr : PyInstanceMethod_New(function.p));
    ok = method.p != nullptr && PyDict_SetItemString(methods.p, pair[0], method.p) == 0;
  }
  if (!ok) {
    Py_DECREF(m);
    return nullptr;
  }
  if (PyModule_AddObject(m, "transfer_methods", Py_NewRef(methods.p)) < 0) {
    Py_DECREF(methods.p);  // the reference PyModule_AddObject did not take
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
