// The blocking collectives of the compiled calls (see _compiled_module.cpp). Each returns None
// when it declines (nothing posted), the completed work, or a pending request's handle (see
// finish). Labels are None or a str (the caller checks).
#include <Python.h>

#include "_compiled.h"

namespace gradcomm_mpi {

PyObject* all_reduce(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {  // (t, label)
  auto* self = reinterpret_cast<Calls*>(self_);
  if (!arity(nargs, 2, "all_reduce")) return nullptr;
  ENTER_OR_DECLINE(self, ctx);
  Handle dt = 0;
  PyObject* tail = nullptr;
  const at::Tensor* t = plain(ctx, args[0], &dt, &tail);
  if (t == nullptr) Py_RETURN_NONE;
  Handle req = 0;
  const int err = mpi.Iallreduce(kInPlace, t->data_ptr(), static_cast<int>(t->numel()), dt,
                                 sum_op, self->comm, &req);
  return finish(self, ctx, {s_all_reduce, t->numel(), tail, types.sum, args[1]}, args[0],
                "MPI_Iallreduce", err, req, {args[0], t});
}

PyObject* reduce_scatter(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  auto* self = reinterpret_cast<Calls*>(self_);  // (output, input, label)
  if (!arity(nargs, 3, "reduce_scatter")) return nullptr;
  ENTER_OR_DECLINE(self, ctx);
  Handle dt = 0, dt_out = 0;
  PyObject *tail = nullptr, *unused = nullptr;
  const at::Tensor* in = plain(ctx, args[1], &dt, &tail);
  const at::Tensor* out = in == nullptr ? nullptr : plain(ctx, args[0], &dt_out, &unused);
  if (out == nullptr || dt_out != dt || in->numel() != self->size * out->numel() ||
      !disjoint(*in, *out))
    Py_RETURN_NONE;
  Handle req = 0;
  const int err = mpi.Ireduce_scatter_block(in->const_data_ptr(), out->data_ptr(),
                                            static_cast<int>(out->numel()), dt, sum_op,
                                            self->comm, &req);
  return finish(self, ctx, {s_reduce_scatter, out->numel(), tail, types.sum, args[2]}, args[0],
                "MPI_Ireduce_scatter_block", err, req, {args[1], in}, {args[0], out});
}

// all_gather(output, input) and all_to_all(output, input) (equal splits: dim 0 divides among
// the ranks and both have one shape, as the Python short path asks).
PyObject* gather_all(const Calls* self, PyObject* const* args, bool to_all) {
  ENTER_OR_DECLINE(self, ctx);
  Handle dt = 0, dt_out = 0;
  PyObject *tail = nullptr, *unused = nullptr;
  const at::Tensor* in = plain(ctx, args[1], &dt, &tail);
  const at::Tensor* out = in == nullptr ? nullptr : plain(ctx, args[0], &dt_out, &unused);
  if (out == nullptr || dt_out != dt || !disjoint(*in, *out)) Py_RETURN_NONE;
  const bool fits = to_all ? in->dim() > 0 && in->size(0) % self->size == 0 &&
                                 out->sizes() == in->sizes()
                           : out->numel() == self->size * in->numel();
  if (!fits) Py_RETURN_NONE;
  Handle req = 0;
  const int n = static_cast<int>(to_all ? in->numel() / self->size : in->numel());
  const int err = (to_all ? mpi.Ialltoall : mpi.Iallgather)(
      in->const_data_ptr(), n, dt, out->data_ptr(), n, dt, self->comm, &req);
  return finish(self, ctx, {to_all ? s_all_to_all : s_all_gather, in->numel(), tail}, args[0],
                to_all ? "MPI_Ialltoall" : "MPI_Iallgather", err, req, {args[1], in},
                {args[0], out});
}

PyObject* all_gather(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "all_gather")) return nullptr;
  return gather_all(reinterpret_cast<Calls*>(self_), args, false);
}

PyObject* all_to_all(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "all_to_all")) return nullptr;
  return gather_all(reinterpret_cast<Calls*>(self_), args, true);
}

PyObject* broadcast(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {  // (t, src)
  auto* self = reinterpret_cast<Calls*>(self_);
  if (!arity(nargs, 2, "broadcast")) return nullptr;
  ENTER_OR_DECLINE(self, ctx);
  Handle dt = 0;
  PyObject* tail = nullptr;
  const at::Tensor* t = plain(ctx, args[0], &dt, &tail);
  const int src = rank_of(args[1], self->size);
  if (t == nullptr || src < 0) Py_RETURN_NONE;
  Ref extra(root_text(self, true, src));
  if (extra.p == nullptr) return nullptr;
  Handle req = 0;
  const int err =
      mpi.Ibcast(t->data_ptr(), static_cast<int>(t->numel()), dt, src, self->comm, &req);
  return finish(self, ctx, {s_broadcast, t->numel(), tail, extra.p, Py_None, src}, args[0],
                "MPI_Ibcast", err, req, {args[0], t});
}

PyObject* reduce(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {  // (t, dst)
  auto* self = reinterpret_cast<Calls*>(self_);
  if (!arity(nargs, 2, "reduce")) return nullptr;
  ENTER_OR_DECLINE(self, ctx);
  Handle dt = 0;
  PyObject* tail = nullptr;
  const at::Tensor* t = plain(ctx, args[0], &dt, &tail);
  const int dst = rank_of(args[1], self->size);
  if (t == nullptr || dst < 0) Py_RETURN_NONE;
  Ref label(root_text(self, false, dst));  // where the Python path's description puts it
  if (label.p == nullptr) return nullptr;
  Handle req = 0;
  const int n = static_cast<int>(t->numel());
  const int err = self->rank == dst
      ? mpi.Ireduce(kInPlace, t->data_ptr(), n, dt, sum_op, dst, self->comm, &req)
      : mpi.Ireduce(t->const_data_ptr(), nullptr, n, dt, sum_op, dst, self->comm, &req);
  return finish(self, ctx, {s_reduce, t->numel(), tail, types.sum, label.p, dst}, args[0],
                "MPI_Ireduce", err, req, {args[0], t});
}

// gather(output, input, dst) and scatter(output, input, src): the root's buffer of size chunks
// (gather's output, scatter's input) is a tensor on the root and None elsewhere.
PyObject* rooted(const Calls* self, PyObject* chunks_obj, PyObject* chunk_obj, PyObject* root_obj,
                 bool gather) {
  ENTER_OR_DECLINE(self, ctx);
  Handle dt = 0, dt_chunks = 0;
  PyObject *tail = nullptr, *unused = nullptr;
  const at::Tensor* chunk = plain(ctx, chunk_obj, &dt, &tail);
  const int root = rank_of(root_obj, self->size);
  if (chunk == nullptr || root < 0) Py_RETURN_NONE;
  const at::Tensor* chunks = nullptr;
  if (self->rank == root) {
    chunks = plain(ctx, chunks_obj, &dt_chunks, &unused);
    if (chunks == nullptr || dt_chunks != dt || chunks->numel() != self->size * chunk->numel() ||
        !disjoint(*chunks, *chunk))
      Py_RETURN_NONE;
  } else if (chunks_obj != Py_None) {
    Py_RETURN_NONE;
  }
  Ref extra(root_text(self, !gather, root));
  if (extra.p == nullptr) return nullptr;
  const Said said{gather ? s_gather : s_scatter, chunk->numel(), tail, extra.p, Py_None, root};
  Handle req = 0;
  const int n = static_cast<int>(chunk->numel());
  if (gather) {
    void* recv = chunks == nullptr ? nullptr : chunks->data_ptr();
    const int err = mpi.Igather(chunk->const_data_ptr(), n, dt, recv, n, dt, root, self->comm,
                                &req);
    return finish(self, ctx, said, chunks == nullptr ? Py_None : chunks_obj, "MPI_Igather", err,
                  req, {chunk_obj, chunk}, {chunks == nullptr ? nullptr : chunks_obj, chunks});
  }
  const void* send = chunks == nullptr ? nullptr : chunks->const_data_ptr();
  const int err = mpi.Iscatter(send, n, dt, chunk->data_ptr(), n, dt, root, self->comm, &req);
  return finish(self, ctx, said, chunk_obj, "MPI_Iscatter", err, req, {chunk_obj, chunk},
                {chunks == nullptr ? nullptr : chunks_obj, chunks});
}

PyObject* gather(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "gather")) return nullptr;
  return rooted(reinterpret_cast<Calls*>(self_), args[0], args[1], args[2], true);
}

PyObject* scatter(PyObject* self_, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 3, "scatter")) return nullptr;
  return rooted(reinterpret_cast<Calls*>(self_), args[1], args[0], args[2], false);
}

}  // namespace gradcomm_mpi
