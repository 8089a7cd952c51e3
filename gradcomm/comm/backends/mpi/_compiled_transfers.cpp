// batch_isend_irecv in the compiled calls (see _compiled_module.cpp): checks, posts and the
// pending works.
#include <Python.h>

#include <climits>

#include "_compiled.h"

namespace gradcomm_mpi {

namespace {

struct Transfer {
  PyObject* tensor;  // a reference Owned drops
  const at::Tensor* t;
  PyObject* tail;  // borrowed from the communicator's _plain_kinds
  int peer, tag;
  bool send;
  Handle request;
};

// Drops the tensors of xs[0, n) at the end of a batch.
struct Owned {
  Transfer* xs;
  Py_ssize_t n = 0;
  ~Owned() {
    for (Py_ssize_t i = 0; i < n; ++i) Py_DECREF(xs[i].tensor);
  }
};

// What the works of one batch share: the communicator's pending list, timeout, stall note and
// transfer counter, read from its __dict__ (nullptr when one is missing there).
struct Shared {
  Ref inflight, timeout, on_timeout, counter;
  explicit Shared(const Context& ctx)
      : inflight(Py_XNewRef(PyDict_GetItem(ctx.dict, s_inflight))),
        timeout(Py_XNewRef(PyDict_GetItem(ctx.dict, s_timeout))),
        on_timeout(Py_XNewRef(PyDict_GetItem(ctx.dict, s_stall_note))),
        counter(Py_XNewRef(PyDict_GetItem(ctx.dict, s_p2p_seq))) {}
  bool complete() const {
    return inflight.p != nullptr && timeout.p != nullptr && on_timeout.p != nullptr &&
           counter.p != nullptr;
  }
};

// The work of one posted transfer, of the class of types.transfer_work, appended to the pending
// list. Its slots hold what MPIWork(request, Description(...), timeout, keepalive, inflight,
// expect_bytes=...) and bind(target, stall_note) set, with two differences: the request is its
// handle (`_handle`), and the description's parts are a tuple (`_said`), which its class's
// `_description` turns into the Description when first read.
PyObject* transfer_work(const Calls* self, const Shared& shared, const Transfer& x,
                        PyObject* seq) {
  Ref extra(x.tag == 0 ? Py_NewRef(PyTuple_GET_ITEM(x.send ? self->send_texts : self->recv_texts,
                                                    x.peer))
                       : PyUnicode_FromFormat(x.send ? "dst=%d tag=%d" : "src=%d tag=%d",
                                              x.peer, x.tag));
  Ref numel(extra.p == nullptr ? nullptr : PyLong_FromLongLong(x.t->numel()));
  if (numel.p == nullptr) return nullptr;
  Ref said(PyTuple_Pack(5, x.send ? s_send : s_recv, seq, numel.p, x.tail, extra.p));
  const Held held{x.tensor, x.t};
  Ref keep(keepalive(&held, 1));
  Ref handle(PyLong_FromLong(x.request));
  Ref expect(x.send ? Py_NewRef(Py_None) : PyLong_FromSize_t(x.t->nbytes()));
  if (said.p == nullptr || keep.p == nullptr || handle.p == nullptr || expect.p == nullptr)
    return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(types.transfer_work);
  PyObject* work = PyBaseObject_Type.tp_new(type, empty_tuple, nullptr);
  if (work == nullptr) return nullptr;
  const WorkSlots& w = work_slots;
  const struct {
    Py_ssize_t offset;
    PyObject* value;
  } slots[] = {{w.said, said.p},
               {w.handle, handle.p},
               {w.polling, Py_False},
               {w.timeout, shared.timeout.p},
               {w.keepalive, keep.p},
               {w.inflight, shared.inflight.p},
               {w.on_timeout, shared.on_timeout.p},
               {w.target, x.send ? Py_None : x.tensor},  // a receive's result lands there
               {w.expect_bytes, expect.p},
               {w.done, Py_False},
               {w.failure, Py_None},
               {w.callbacks, empty_tuple},
               {w.error, Py_None},
               {w.running, Py_False}};
  for (const auto& slot : slots) slot_set(work, slot.offset, slot.value);
  if (PyList_Append(shared.inflight.p, work) < 0) Py_CLEAR(work);
  return work;
}

}  // namespace

// batch(ops): ops a list of 1-64 P2POp. Declines (None, nothing posted) unless every op is
// exactly a P2POp of P2PKind SEND or RECV with a plain tensor (see plain), an int peer other than
// this rank and an int tag in [0, tag_limit). Else posts the receives, then the sends, each kind
// in list order (so same-tag messages still match in order), adds their works to the pending
// list in that order, and returns the works in list order. An MPI error raises, once every
// transfer posted before it has its work in the pending list.
PyObject* batch(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Calls*>(self_);
  if (!arity(nargs, 1, "batch")) return nullptr;
  PyObject* ops = args[0];
  if (!PyList_CheckExact(ops)) Py_RETURN_NONE;  // a Calls exists only once set_types ran
  const Py_ssize_t n = PyList_GET_SIZE(ops);
  if (n == 0 || n > kMaxBatch) Py_RETURN_NONE;
  ENTER_OR_DECLINE(self, ctx);
  Transfer xs[kMaxBatch];
  Owned owned{xs};
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* op = PyList_GET_ITEM(ops, i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(op)) != types.p2pop) Py_RETURN_NONE;
    Transfer& x = xs[i];
    PyObject* kind = slot_get(op, op_slots.op);
    PyObject* tensor = slot_get(op, op_slots.tensor);
    PyObject* peer = slot_get(op, op_slots.peer);
    PyObject* tag = slot_get(op, op_slots.tag);
    if (kind == nullptr || tensor == nullptr || peer == nullptr || tag == nullptr)
      Py_RETURN_NONE;  // an op made without __init__: the Python path says what is wrong
    x.send = kind == types.send_kind;
    x.tensor = Py_NewRef(tensor);
    owned.n = i + 1;
    Handle unused = 0;
    x.t = x.send || kind == types.recv_kind ? plain(ctx, x.tensor, &unused, &x.tail) : nullptr;
    x.peer = rank_of(peer, self->size);
    x.tag = rank_of(tag, static_cast<int>(types.tag_limit));
    if (x.t == nullptr || x.peer < 0 || x.peer == self->rank || x.tag < 0 ||
        x.t->nbytes() > static_cast<size_t>(INT_MAX))
      Py_RETURN_NONE;
  }
  const Shared shared(ctx);
  if (!shared.complete()) Py_RETURN_NONE;
  bool failed_send = false;
  Py_ssize_t order[kMaxBatch];  // the transfers posted, in posting order
  Py_ssize_t posted = 0;
  int err = 0;
  for (const bool sends : {false, true}) {  // receives, then sends
    for (Py_ssize_t i = 0; i < n && err == 0; ++i) {
      Transfer& x = xs[i];
      if (x.send != sends) continue;
      const int bytes = static_cast<int>(x.t->nbytes());
      err = x.send ? mpi.Isend(x.t->const_data_ptr(), bytes, byte_type, x.peer, x.tag,
                               self->comm, &x.request)
                   : mpi.Irecv(x.t->data_ptr(), bytes, byte_type, x.peer, x.tag, self->comm,
                               &x.request);
      if (err == 0) order[posted++] = i;
      else failed_send = x.send;
    }
  }
  // Every posted transfer gets its pending work, even when a later post failed: MPI still moves
  // its data, so its buffers must stay alive and its request be completed.
  PyObject* made[kMaxBatch] = {};
  PyObject* seqs[kMaxBatch] = {};  // numbered in list order, as the Python path numbers them
  bool ok = true;
  for (Py_ssize_t i = 0; i < n && ok; ++i) ok = (seqs[i] = PyIter_Next(shared.counter.p)) != nullptr;
  for (Py_ssize_t k = 0; k < posted && ok; ++k)
    ok = (made[order[k]] = transfer_work(self, shared, xs[order[k]], seqs[order[k]])) != nullptr;
  for (PyObject* seq : seqs) Py_XDECREF(seq);
  PyObject* works = ok && err == 0 ? PyList_New(n) : nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (works != nullptr) PyList_SET_ITEM(works, i, made[i]);
    else Py_XDECREF(made[i]);
  }
  if (err != 0 && ok) return mpi_error(failed_send ? "MPI_Isend" : "MPI_Irecv", err);
  return works;
}

// batch_isend_irecv(comm, ops): the MPI communicator's batch_isend_irecv, bound to each
// instance whose class has Communicator.batch_isend_irecv (compiled.bind_batch): the compiled batch
// of comm's Calls, or, for a batch it declines, that method, which checks and raises as always.
// When the class's method was replaced after the binding (a patch), it unbinds itself and calls
// what Python's attribute lookup finds, with the arguments as given.
PyObject* batch_isend_irecv(PyObject*, PyObject* const* args, Py_ssize_t nargs,
                            PyObject* kwnames) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "batch_isend_irecv() needs its communicator");
    return nullptr;
  }
  PyObject* comm = args[0];
  Ref method(PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(comm)), s_batch_isend_irecv));
  if (method.p == nullptr) return nullptr;
  if (method.p != types.batch_method) {
    Ref dict(PyObject_GenericGetDict(comm, nullptr));
    if (dict.p == nullptr) return nullptr;
    if (PyDict_DelItem(dict.p, s_batch_isend_irecv) < 0) {
      if (!PyErr_ExceptionMatches(PyExc_KeyError)) return nullptr;
      PyErr_Clear();
    }
    Ref found(PyObject_GetAttr(comm, s_batch_isend_irecv));
    if (found.p == nullptr) return nullptr;
    return PyObject_Vectorcall(found.p, args + 1, nargs - 1, kwnames);
  }
  const Py_ssize_t given = nargs + (kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames));
  if (given != 2 ||
      (kwnames != nullptr &&
       PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "ops") != 0)) {
    PyErr_SetString(PyExc_TypeError, "batch_isend_irecv() takes one argument, ops");
    return nullptr;
  }
  PyObject* ops = args[1];
  Ref calls(PyObject_GetAttr(comm, s_compiled));
  if (calls.p == nullptr) return nullptr;
  if (Py_IS_TYPE(calls.p, &calls_type)) {
    PyObject* works = batch(calls.p, &ops, 1);
    if (works != Py_None) return works;  // the works, or an error
    Py_DECREF(works);
  }
  PyObject* call[] = {comm, ops};
  return PyObject_Vectorcall(method.p, call, 2, nullptr);
}

}  // namespace gradcomm_mpi
