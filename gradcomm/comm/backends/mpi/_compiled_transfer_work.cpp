// The compiled methods of a transfer's work (see _compiled_module.cpp). batch() makes its works
// of the class compiled.py builds from these: an MPIWork whose state is in slots (see WorkSlots),
// whose request is an MPI handle in `_handle` (None once complete) instead of an mpi4py Request,
// and whose wait(), _wait() and _test() are the functions here, so a wait runs no Python code.
// Completion is what MPIWork's is (work.py): drop the buffers, leave the communicator's pending
// list, check a receive's size; an MPI error or a size mismatch becomes the `_failure` every later
// call raises.
//
// While a thread polls a request without the GIL, `_polling` is True: another thread's _test()
// then answers False and its wait polls nothing until the first is done (MPI forbids testing one
// request from two threads at once).
#include <Python.h>

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <iterator>
#include <chrono>
#include <cmath>

#include "_compiled.h"

namespace gradcomm_mpi {

// The polling schedule of MPIWork.wait (work.py): bursts of 16 Test() calls back to back for
// 1 ms, separated by sched_yield() until 1 s, then by sleeps doubling from 10 us to 1 ms.
constexpr int kTestsPerCheck = 16;
constexpr double kYieldAfterS = 1e-3;
constexpr double kSpinS = 1.0;
constexpr double kSleepStartS = 1e-5;
constexpr double kSleepCapS = 1e-3;
// Seconds without the GIL between two runs of the signal handlers (a Ctrl-C's delay).
constexpr double kSignalCheckS = 5e-3;

int poll(Handle* request, Status* status, double limit, bool answer_signals, int* err) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  double pause = 0.0, waited = 0.0;
  int flag = 0;
  *err = 0;
  while (true) {
    const double check_at = waited + kSignalCheckS;
    Py_BEGIN_ALLOW_THREADS;
    while (true) {
      for (int i = 0; i < kTestsPerCheck && flag == 0 && *err == 0; ++i)
        *err = mpi.Test(request, &flag, status);
      if (flag != 0 || *err != 0) break;
      waited = std::chrono::duration<double>(clock::now() - start).count();
      if ((limit >= 0.0 && waited >= limit) || (answer_signals && waited >= check_at)) break;
      if (waited >= kSpinS) {
        pause = std::clamp(pause * 2.0, kSleepStartS, kSleepCapS);
        const timespec ts{0, static_cast<long>(pause * 1e9)};
        nanosleep(&ts, nullptr);
      } else if (waited >= kYieldAfterS) {
        sched_yield();  // let a peer rank that shares this core run
      }
    }
    Py_END_ALLOW_THREADS;
    if (flag != 0 || *err != 0) return 1;
    if (limit >= 0.0 && waited >= limit) return 0;
    if (PyErr_CheckSignals() < 0) return -1;
  }
}

namespace {

PyObject* work_wait = nullptr;  // Work.wait, the Python method: every case but the common one
double wait_budget = 0.0;       // seconds a wait polls before it hands over to Work.wait

const WorkSlots& w = work_slots;

// The work's slot at `offset` (borrowed; None when unset).
PyObject* get(PyObject* self, Py_ssize_t offset) {
  PyObject* v = slot_get(self, offset);
  return v == nullptr ? Py_None : v;
}

// self is a work batch() made (a TypeError otherwise: these are its class's methods only).
bool is_work(PyObject* self) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(self)) == types.transfer_work &&
      slot_get(self, w.handle) != nullptr)
    return true;
  PyErr_SetString(PyExc_TypeError, "not a work made by a compiled batch_isend_irecv");
  return false;
}

// Raise the work's `_failure` when it has one (returns true then).
bool raise_failure(PyObject* self) {
  PyObject* failure = get(self, w.failure);
  if (failure == Py_None) return false;
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(failure)), failure);
  return true;
}

// Keep `text` (a new reference, or nullptr) as the work's failure, a RuntimeError "<description>:
// text", and raise it.
PyObject* fail(PyObject* self, PyObject* text) {
  Ref said(text);
  if (said.p == nullptr) return nullptr;
  Ref desc(PyObject_GetAttr(self, s_description));
  Ref line(desc.p == nullptr ? nullptr : PyUnicode_FromFormat("%S: %U", desc.p, said.p));
  Ref failure(line.p == nullptr ? nullptr : PyObject_CallOneArg(PyExc_RuntimeError, line.p));
  if (failure.p == nullptr) return nullptr;
  slot_set(self, w.failure, failure.p);
  PyErr_SetObject(PyExc_RuntimeError, failure.p);
  return nullptr;
}

// The request completed (status: its status; nullptr: with an MPI error): drop the buffers,
// leave the pending list, and for a receive check the size it got. 0, or -1 with the failure
// raised.
int settle(PyObject* self, const Status* status) {
  slot_set(self, w.handle, Py_None);
  slot_set(self, w.keepalive, Py_None);
  Ref inflight(Py_NewRef(get(self, w.inflight)));
  slot_set(self, w.inflight, Py_None);
  if (PyList_CheckExact(inflight.p)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(inflight.p); ++i) {
      if (PyList_GET_ITEM(inflight.p, i) != self) continue;
      if (PyList_SetSlice(inflight.p, i, i + 1, nullptr) < 0) return -1;
      break;
    }
  }
  PyObject* expect = get(self, w.expect_bytes);
  if (status == nullptr || expect == Py_None) return 0;  // a send, or no status to check
  int got = 0;
  const int err = mpi.Get_count(status, byte_type, &got);
  if (err != 0) return mpi_error("MPI_Get_count", err), -1;
  const long long want = PyLong_AsLongLong(expect);
  if (want == -1 && PyErr_Occurred()) return -1;
  if (got == want) return 0;
  fail(self, PyUnicode_FromFormat("received %d bytes, the buffer holds %lld", got, want));
  return -1;
}

// The request failed with MPI error `code`: the work's failure names the error's class, as
// MPIWork._failed does.
PyObject* failed(PyObject* self, int code) {
  int error_class = code;
  char text[kMaxErrorString + 1] = {};
  int len = 0;
  if (mpi.Error_class(code, &error_class) != 0 || mpi.Error_string(error_class, text, &len) != 0)
    len = 0;
  text[std::clamp(len, 0, kMaxErrorString)] = '\0';
  if (settle(self, nullptr) < 0) return nullptr;
  return fail(self, PyUnicode_FromString(text));
}

// The work's request handle into *out: 1, or 0 when it completed already (handle None), -1 with
// an error.
int handle_of_work(PyObject* self, Handle* out) {
  PyObject* handle = get(self, w.handle);
  if (handle == Py_None) return 0;
  const long v = PyLong_AsLong(handle);
  if (v == -1 && PyErr_Occurred()) return -1;
  *out = static_cast<Handle>(v);
  return 1;
}

// Poll the work's request without the GIL (see poll), `_polling` set meanwhile. 1 done (and
// settled), 0 still pending after `limit`, -1 with an error (a failure, or a signal handler's).
int poll_work(PyObject* self, Handle request, double limit) {
  slot_set(self, w.polling, Py_True);
  Status status{};
  int err = 0;
  const int r = poll(&request, &status, limit, true, &err);
  slot_set(self, w.polling, Py_False);
  if (r < 0) return -1;
  if (err != 0) return failed(self, err), -1;
  if (r == 0) return 0;
  return settle(self, &status) < 0 ? -1 : 1;
}

// Call Work.wait(self, *args, **kwargs).
PyObject* python_wait(PyObject* self, PyObject* const* args, Py_ssize_t n, PyObject* kwnames) {
  PyObject* stack[8];
  const Py_ssize_t total = n + (kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames));
  if (total + 1 > static_cast<Py_ssize_t>(std::size(stack))) {
    PyErr_SetString(PyExc_TypeError, "wait() takes at most one argument, timeout");
    return nullptr;
  }
  stack[0] = self;
  std::copy(args, args + total, stack + 1);
  return PyObject_Vectorcall(work_wait, stack, n + 1, kwnames);
}

}  // namespace

// _test(self): Test() the request once; True when complete (MPIWork._test).
PyObject* transfer_test(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 1, "_test") || !is_work(args[0])) return nullptr;
  PyObject* self = args[0];
  if (raise_failure(self)) return nullptr;
  Handle request = 0;
  const int have = handle_of_work(self, &request);
  if (have < 0) return nullptr;
  if (have == 0) Py_RETURN_TRUE;
  if (get(self, w.polling) == Py_True) Py_RETURN_FALSE;  // another thread is testing it
  Status status{};
  int flag = 0;
  const int err = mpi.Test(&request, &flag, &status);
  if (err != 0) return failed(self, err);
  if (flag == 0) Py_RETURN_FALSE;
  if (settle(self, &status) < 0) return nullptr;
  Py_RETURN_TRUE;
}

// _wait(self, timeout): poll until complete; TimeoutError after `timeout` seconds (None: never)
// (MPIWork._wait).
PyObject* transfer_wait_for(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity(nargs, 2, "_wait") || !is_work(args[0])) return nullptr;
  PyObject* self = args[0];
  double limit = -1.0;
  if (args[1] != Py_None && ((limit = PyFloat_AsDouble(args[1])) == -1.0 && PyErr_Occurred()))
    return nullptr;
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  while (true) {
    if (raise_failure(self)) return nullptr;
    Handle request = 0;
    const int have = handle_of_work(self, &request);
    if (have < 0) return nullptr;
    if (have == 0) Py_RETURN_NONE;
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    const double left = limit < 0.0 ? -1.0 : std::max(limit - waited, 0.0);
    if (get(self, w.polling) != Py_True) {
      const int r = poll_work(self, request, left);
      if (r < 0) return nullptr;
      if (r == 1) Py_RETURN_NONE;
    } else if (left != 0.0) {  // another thread polls it: look again shortly
      Py_BEGIN_ALLOW_THREADS;
      const timespec ts{0, 50000};
      nanosleep(&ts, nullptr);
      Py_END_ALLOW_THREADS;
      if (PyErr_CheckSignals() < 0) return nullptr;
      continue;
    }
    Ref desc(PyObject_GetAttr(self, s_description));
    if (desc.p != nullptr)
      PyErr_Format(PyExc_TimeoutError, "%S: MPI request still pending", desc.p);
    return nullptr;
  }
}

// wait(self, timeout=None): Work.wait. Without a timeout, on a work nothing waited for yet, it
// polls here for up to the wait budget (or the work's timeout when shorter) and returns once
// complete, having run the callbacks as Work._finish does; every other case, and a request still
// pending then, is Work.wait's (which calls _wait above).
PyObject* transfer_wait(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "wait() needs its work");
    return nullptr;
  }
  PyObject* self = args[0];
  if (!is_work(self)) return nullptr;
  Handle request = 0;
  const int have = handle_of_work(self, &request);
  if (have < 0) return nullptr;
  PyObject* timeout = get(self, w.timeout);
  const double t = PyFloat_CheckExact(timeout)  ? PyFloat_AS_DOUBLE(timeout)
                   : PyLong_CheckExact(timeout) ? PyLong_AsDouble(timeout)
                                                : -1.0;
  if (t == -1.0 && PyErr_Occurred()) PyErr_Clear();  // an int too large: Work.wait's case
  // a timeout argument, one this wait cannot take, a work done, failed or polled by another
  // thread: Work.wait's case
  if (kwnames != nullptr || nargs > 2 || (nargs == 2 && args[1] != Py_None) || have == 0 ||
      (timeout != Py_None && !(t >= 0.0 && std::isfinite(t))) ||
      get(self, w.done) != Py_False || get(self, w.failure) != Py_None ||
      get(self, w.polling) != Py_False)
    return python_wait(self, args + 1, nargs - 1, kwnames);
  const double limit = timeout == Py_None ? wait_budget : std::min(wait_budget, t);
  const int r = poll_work(self, request, limit);
  if (r < 0) return nullptr;
  if (r == 0) return python_wait(self, args + 1, nargs - 1, nullptr);
  const int any = PyObject_IsTrue(get(self, w.callbacks));
  if (any < 0) return nullptr;
  if (any == 1) return PyObject_CallMethodNoArgs(self, s_finish);  // runs and raises them
  slot_set(self, w.done, Py_True);
  Py_RETURN_NONE;
}

bool set_transfer_work(PyObject* wait_method, double budget) {
  if (!PyCallable_Check(wait_method) || !(budget > 0.0)) {
    PyErr_SetString(PyExc_ValueError, "need Work.wait and a budget > 0");
    return false;
  }
  Py_XSETREF(work_wait, Py_NewRef(wait_method));
  wait_budget = budget;
  return true;
}

}  // namespace gradcomm_mpi
