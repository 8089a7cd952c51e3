// batch_isend_irecv in the compiled calls (see _compiled_module.cpp): checks, posts and the
// pending MPIWorks.
#include <Python.h>

#include <climits>

#include "_compiled.h"

namespace gradcomm_mpi {

namespace {

struct Transfer {
  PyObject* tensor;  // borrowed from the op
  const at::Tensor* t;
  PyObject* tail;  // borrowed from the communicator's _plain_kinds
  int peer, tag;
  bool send;
  Handle request;
};

// The pending MPIWork of one posted transfer, as MPIWork(request, Description(...), timeout,
// keepalive, inflight, expect_bytes=...) and bind(target, stall_note) make it (see
// pending_work).
PyObject* transfer_work(const Context& ctx, const Transfer& x) {
  Ref extra(PyUnicode_FromFormat(x.send ? "dst=%d tag=%d" : "src=%d tag=%d", x.peer, x.tag));
  if (extra.p == nullptr) return nullptr;
  Ref desc(describe(ctx.owner, s_p2p_seq, x.send ? s_send : s_recv, x.t->numel(), x.tail,
                    extra.p, Py_None, Py_None));
  if (desc.p == nullptr) return nullptr;
  const Held held{x.tensor, x.t};
  // a receive's result lands in its tensor; a send has nothing to write
  Ref work(pending_work(ctx, desc.p, x.request, &held, 1, x.send ? Py_None : x.tensor));
  if (work.p == nullptr) return nullptr;
  if (!x.send) {  // a receive checks the size it got
    Ref expect(PyLong_FromSize_t(x.t->nbytes()));
    Ref status(PyObject_CallNoArgs(types.status));
    if (expect.p == nullptr || status.p == nullptr ||
        PyObject_SetAttr(work.p, s_expect_bytes, expect.p) < 0 ||
        PyObject_SetAttr(work.p, s_status, status.p) < 0)
      return nullptr;
  }
  return Py_NewRef(work.p);
}

}  // namespace

// batch(ops): ops a list of 1-64 P2POp. Declines (None, nothing posted) unless every op is
// exactly a P2POp of P2PKind SEND or RECV with a plain tensor (see plain), an int peer other than
// this rank and an int tag in [0, tag_limit). Else posts the receives, then the sends, each kind
// in list order (so same-tag messages still match in order), and returns their pending MPIWorks
// in list order. An MPI error raises; what was posted is left to MPI.
PyObject* batch(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Calls*>(self_);
  if (!arity(nargs, 1, "batch")) return nullptr;
  PyObject* ops = args[0];
  if (!PyList_CheckExact(ops)) Py_RETURN_NONE;  // a Calls exists only once set_types ran
  const Py_ssize_t n = PyList_GET_SIZE(ops);
  if (n == 0 || n > kMaxBatch) Py_RETURN_NONE;
  ENTER_OR_DECLINE(self, ctx);
  Transfer xs[kMaxBatch];
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* op = PyList_GET_ITEM(ops, i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(op)) != types.p2pop || PyTuple_GET_SIZE(op) != 4)
      Py_RETURN_NONE;
    Transfer& x = xs[i];
    PyObject* kind = PyTuple_GET_ITEM(op, 0);
    x.send = kind == types.send_kind;
    x.tensor = PyTuple_GET_ITEM(op, 1);
    Handle unused = 0;
    x.t = x.send || kind == types.recv_kind ? plain(ctx, x.tensor, &unused, &x.tail) : nullptr;
    x.peer = rank_of(PyTuple_GET_ITEM(op, 2), self->size);
    x.tag = rank_of(PyTuple_GET_ITEM(op, 3), static_cast<int>(types.tag_limit));
    if (x.t == nullptr || x.peer < 0 || x.peer == self->rank || x.tag < 0 ||
        x.t->nbytes() > static_cast<size_t>(INT_MAX))
      Py_RETURN_NONE;
  }
  for (const bool sends : {false, true}) {  // receives, then sends
    for (Py_ssize_t i = 0; i < n; ++i) {
      Transfer& x = xs[i];
      if (x.send != sends) continue;
      const int bytes = static_cast<int>(x.t->nbytes());
      const int err = x.send ? mpi.Isend(x.t->const_data_ptr(), bytes, byte_type, x.peer, x.tag,
                                         self->comm, &x.request)
                             : mpi.Irecv(x.t->data_ptr(), bytes, byte_type, x.peer, x.tag,
                                         self->comm, &x.request);
      if (err != 0) return mpi_error(x.send ? "MPI_Isend" : "MPI_Irecv", err);
    }
  }
  PyObject* works = PyList_New(n);
  for (Py_ssize_t i = 0; works != nullptr && i < n; ++i) {
    PyObject* work = transfer_work(ctx, xs[i]);
    if (work == nullptr) Py_CLEAR(works);
    else PyList_SET_ITEM(works, i, work);
  }
  return works;
}

}  // namespace gradcomm_mpi
