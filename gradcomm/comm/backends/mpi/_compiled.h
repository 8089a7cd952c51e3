// Declarations shared by the compiled calls' sources (_compiled_*.cpp); see _compiled_module.cpp.
#pragma once

#include <Python.h>

#include <cstdint>

#include <torch/csrc/autograd/python_variable.h>

namespace gradcomm_mpi {

// ---------------------------------------------------------------- MPI, MPICH ABI

using Handle = int;  // MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request
struct Status {
  int count_lo, count_hi_and_cancelled, source, tag, error;
};
void* const kInPlace = reinterpret_cast<void*>(-1);         // MPI_IN_PLACE
Status* const kStatusIgnore = reinterpret_cast<Status*>(1);  // MPI_STATUS_IGNORE
constexpr int kMaxErrorString = 1024;  // >= MPI_MAX_ERROR_STRING (512 in MPICH)
constexpr Py_ssize_t kMaxBatch = 64;   // longer batches take the Python path

struct Mpi {
  int (*Iallreduce)(const void*, void*, int, Handle, Handle, Handle, Handle*);
  int (*Ireduce_scatter_block)(const void*, void*, int, Handle, Handle, Handle, Handle*);
  int (*Iallgather)(const void*, int, Handle, void*, int, Handle, Handle, Handle*);
  int (*Ialltoall)(const void*, int, Handle, void*, int, Handle, Handle, Handle*);
  int (*Ibcast)(void*, int, Handle, int, Handle, Handle*);
  int (*Ireduce)(const void*, void*, int, Handle, Handle, int, Handle, Handle*);
  int (*Igather)(const void*, int, Handle, void*, int, Handle, int, Handle, Handle*);
  int (*Iscatter)(const void*, int, Handle, void*, int, Handle, int, Handle, Handle*);
  int (*Isend)(const void*, int, Handle, int, int, Handle, Handle*);
  int (*Irecv)(void*, int, Handle, int, int, Handle, Handle*);
  int (*Test)(Handle*, int*, Status*);
  int (*Get_count)(const Status*, Handle, int*);
  int (*Error_class)(int, int*);
  int (*Error_string)(int, char*, int*);
};
extern Mpi mpi;
extern Handle sum_op;     // MPI_SUM
extern Handle byte_type;  // MPI_BYTE: transfers move bytes, as the Python path does
// MPI datatype per torch scalar type, 0 where these calls decline the dtype (set_datatypes).
extern Handle datatypes[static_cast<int>(c10::ScalarType::NumOptions)];

PyObject* mpi_error(const char* call, int code);

// ---------------------------------------------------------------- Python objects

// Classes and constants from gradcomm and mpi4py (set_types).
struct Types {
  PyObject* completed_work = nullptr;  // CompletedWork
  PyObject* mpi_work = nullptr;        // MPIWork
  PyObject* description = nullptr;     // Description
  PyObject* p2pop = nullptr;           // P2POp: only its exact instances are taken
  PyObject* send_kind = nullptr;       // P2PKind.SEND
  PyObject* recv_kind = nullptr;       // P2PKind.RECV
  PyObject* sum = nullptr;             // ReduceOp.SUM
  PyObject* fromhandle = nullptr;      // MPI.Request.fromhandle
  PyObject* transfer_work = nullptr;   // the class of batch()'s works (compiled.py)
  PyObject* batch_method = nullptr;    // Communicator.batch_isend_irecv, the compiled one's base
  long tag_limit = 0;
};
extern Types types;

// Attribute names, interned at module init.
extern PyObject *s_closed, *s_cached_checks, *s_profiler, *s_inflight, *s_adapter, *s_stalls,
    *s_stalled, *s_plain_kinds, *s_seq, *s_p2p_seq, *s_timeout, *s_stall_note, *s_work_timeout,
    *s_description, *s_target, *s_request, *s_keepalive, *s_on_timeout, *s_opname, *s_numel,
    *s_tail, *s_extra, *s_label, *s_text, *s_root, *s_splits, *s_empty, *s_all_reduce,
    *s_reduce_scatter, *s_all_gather, *s_all_to_all, *s_broadcast, *s_reduce, *s_gather,
    *s_scatter, *s_send, *s_recv, *s_finish, *s_batch_isend_irecv, *s_compiled, *empty_tuple;

// A new reference, dropped at the end of its scope.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// ---------------------------------------------------------------- slots

// The object in obj's slot at `offset` (borrowed; nullptr when unset).
inline PyObject* slot_get(PyObject* obj, Py_ssize_t offset) {
  return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
}
// Put `value` in obj's slot at `offset`, dropping what was there.
inline void slot_set(PyObject* obj, Py_ssize_t offset, PyObject* value) {
  PyObject** at = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  PyObject* old = *at;
  *at = Py_NewRef(value);
  Py_XDECREF(old);
}

// Offsets of the __slots__ of P2POp and of batch()'s works, which set_types reads from their
// classes' member descriptors: the calls read and write them without an attribute lookup.
struct OpSlots {
  Py_ssize_t op, tensor, peer, tag;
};
struct WorkSlots {
  Py_ssize_t said, handle, polling, timeout, keepalive, inflight, on_timeout, target,
      expect_bytes, done, failure, callbacks, error, running;
};
extern OpSlots op_slots;
extern WorkSlots work_slots;

// ---------------------------------------------------------------- the communicator's calls

extern PyTypeObject calls_type;  // Calls (_compiled_module.cpp)

struct Calls {
  PyObject_HEAD
  PyObject* owner;  // weak reference to the Python communicator
  PyObject* src_texts;  // ("src=0", "src=1", ...): the descriptions' root texts, one per rank
  PyObject* dst_texts;  // ("dst=0", ...)
  PyObject* send_texts;  // ("dst=0 tag=0", ...): the descriptions' texts of tag-0 transfers
  PyObject* recv_texts;  // ("src=0 tag=0", ...)
  Handle comm;
  int size;
  int rank;
  double budget;  // seconds a collective polls before it hands a pending request back
};

// What a call reads of its communicator once its state lets the call take this path.
struct Context {
  PyObject* owner = nullptr;  // borrowed (the weak reference's object, alive for the call)
  PyObject* dict = nullptr;   // its __dict__, a new reference
  PyObject* kinds = nullptr;  // its _plain_kinds: {dtype: description tail}, a new reference
  ~Context() {
    Py_XDECREF(kinds);
    Py_XDECREF(dict);
  }
};

// 1 when the communicator's state lets a call take this path, as IssuePath._fast_tail asks (open,
// debug OFF with the base checks and more than one rank, no profiler, no stall), with nothing
// pending (the Python path drives pending works first) and no device adapter; 0 when not; -1
// with an error set.
//
// The attributes are read from the communicator's __dict__, where its constructor puts them (one
int enter(const Calls* self, Context* ctx);

#define ENTER_OR_DECLINE(self, ctx)   \
  Context ctx;                        \
  do {                                \
    const int r_ = enter(self, &ctx); \
    if (r_ < 0) return nullptr;       \
    if (r_ == 0) Py_RETURN_NONE;      \
  } while (0)

// The tensor behind obj when these calls take it: exactly a Tensor or Parameter (a subclass may
// answer the rest its own way), with storage, on the CPU, strided, contiguous, without a negative
// or conjugate bit, 1 to INT_MAX elements, of a dtype set_datatypes named whose description tail
// the communicator has cached (a first call of each dtype takes the Python path, which checks
// and caches it). Else nullptr. *tail: the tail, borrowed from ctx.kinds.
const at::Tensor* plain(const Context& ctx, PyObject* obj, Handle* datatype, PyObject** tail);

bool disjoint(const at::Tensor& a, const at::Tensor& b);

// The rank when obj is exactly an int in [0, size), else -1.
int rank_of(PyObject* obj, int size);

// A Description of the next number of the communicator's counter `counter` (_seq or _p2p_seq).
PyObject* describe(PyObject* owner, PyObject* counter, PyObject* opname, int64_t numel,
                   PyObject* tail, PyObject* extra, PyObject* label, PyObject* root);

// What a collective's description says besides the communicator's number (see completed).
struct Said {
  PyObject* opname;
  int64_t numel;
  PyObject* tail;
  PyObject* extra = s_empty;
  PyObject* label = Py_None;
  int root = -1;  // -1: none
};

// After a post: Test() back to back for 1 ms, then with sched_yield() between bursts (a peer that
// shares this core gets to run), until done or the budget is spent, without the GIL. Returns the
// completed collective's CompletedWork, described as the Python path describes it and bound to
// target (None: none), when done; the request's handle (as mpi4py writes handles) when still
// pending, its MPIWork (see pending_work), which the caller waits for as the Python path does;
// or raises. `a` and `b` (b.obj nullptr: none) are the tensors MPI works on: their storages are
// held while the GIL is released (another thread's t.set_(...) must not free MPI's memory), and
// by a pending work.
struct Held {
  PyObject* obj;
  const at::Tensor* t;
};
PyObject* finish(const Calls* self, const Context& ctx, const Said& said, PyObject* target,
                 const char* call, int err, Handle request, Held a, Held b = {nullptr, nullptr});

// (held[0].obj, ..., held[n-1].obj, their storages): what a work keeps alive while MPI uses the
// memory (t.set_(...) or t.data = ... meanwhile must not free it). nullptr with an error set.
PyObject* keepalive(const Held* held, int n);

// A pending MPIWork of `request`, as MPIWork(request, desc, timeout, keepalive, inflight) and
// bind(target, stall_note) make it, appended to the communicator's pending list before any Python
// code can run (a KeyboardInterrupt must not lose it); keepalive: the tensors of `held`, then
// their storages.
PyObject* pending_work(const Context& ctx, PyObject* desc, Handle request, const Held* held,
                       int n, PyObject* target);

// Test() *request (its status into *status) until it completes, MPI returns an error (in *err),
// or `limit` seconds pass (< 0: no limit), without the GIL, on MPIWork.wait's schedule (see
// _compiled_transfer_work.cpp). With answer_signals, it takes the GIL back every few ms to run
// the signal handlers. 1: complete or an MPI error; 0: the limit passed; -1: a signal handler
// raised (the request is still pending).
int poll(Handle* request, Status* status, double limit, bool answer_signals, int* err);

bool arity(Py_ssize_t got, Py_ssize_t want, const char* name);

// "src=3" or "dst=3", as the Python path's descriptions say (a new reference).
PyObject* root_text(const Calls* self, bool src, int root);

// The calls (METH_FASTCALL methods of Calls): _compiled_collectives.cpp, _compiled_transfers.cpp.
PyObject* all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* reduce_scatter(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* all_gather(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* all_to_all(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* broadcast(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* gather(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* scatter(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* batch(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* batch_isend_irecv(PyObject* module, PyObject* const* args, Py_ssize_t nargs,
                            PyObject* kwnames);

// The compiled methods of batch()'s works (_compiled_transfer_work.cpp), module functions taking
// the work first.
PyObject* transfer_test(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* transfer_wait_for(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* transfer_wait(PyObject* module, PyObject* const* args, Py_ssize_t nargs,
                        PyObject* kwnames);
// Work.wait (every wait the compiled one does not take) and the seconds the compiled one polls
// before it hands over to it. False with an error set when they are not that.
bool set_transfer_work(PyObject* wait_method, double budget);

}  // namespace gradcomm_mpi
