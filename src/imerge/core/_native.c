/* imerge.core._native: the shard's data plane in C (see imerge/core/native.py, its only caller).
 *
 * Bytes are received from a socket straight into a tensor's memory in cache-sized chunks, each chunk checked
 * for NaN and infinity while it is still in the cache; the workers' rows of a block are summed in worker order
 * and divided into the round's mean in one pass. Every function takes raw addresses and lengths (no torch
 * headers: the caller passes tensor.data_ptr()) and runs with the GIL released. The arithmetic is IEEE float32,
 * one rounding per operation, in torch's order (compiled with -ffp-contract=off: no fused multiply-add), so
 * that its results are torch's to the bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#define RECV_CHUNK (256 * 1024) /* bytes per recv: a chunk is checked while it is in the L2 cache */
#define MEAN_CHUNK 2048         /* floats per pass of the mean: the running sum stays in the L1 cache */
#define MAX_ROWS 65536
#define MAX_SMALL_ROWS 4096     /* rows of a fused step (their chunk pointers live on the stack) */

enum { RECV_DONE = 0, RECV_CLOSED = 1, RECV_TIMEOUT = 2, RECV_PAUSED = 3 };

/* The hot loops are compiled for AVX-512, AVX2 and the baseline, and the loader picks what the CPU has (wider
 * vectors, the same IEEE operations: -ffp-contract=off keeps a multiply and an add two roundings). */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* Whether the n floats at p are all finite (an exponent of all ones is an infinity or a NaN). */
static inline int finite_run(const float *p, size_t n) {
    const uint32_t *bits = (const uint32_t *)p;
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad |= (uint32_t)((bits[i] & 0x7f800000u) == 0x7f800000u);
    return bad == 0;
}

CLONES static int floats_finite(const float *p, size_t n) { return finite_run(p, n); }

/* The last step of the mean, in one pass: out[i] = (partial[i] + last[i]) / divisor (partial: the sum of the
 * rows before the last, or NULL with one row), times the reciprocal where that is exact (a power of two: its
 * reciprocal is exact, and the product is the quotient rounded the same). Returns whether all are finite. */
static inline int finish_mean(float *out, const float *partial, const float *last, size_t n, float divisor,
                              int power_of_two) {
    float reciprocal = 1.0f / divisor;
    uint32_t bad = 0;
#define FINISH(value)                                                                                         \
    for (size_t i = 0; i < n; i++) {                                                                          \
        float mean = (value);                                                                                 \
        uint32_t bits;                                                                                        \
        memcpy(&bits, &mean, sizeof bits);                                                                    \
        out[i] = mean;                                                                                        \
        bad |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u);                                             \
    }
    if (partial == NULL && power_of_two) {
        FINISH(last[i] * reciprocal)
    } else if (partial == NULL) {
        FINISH(last[i] / divisor)
    } else if (power_of_two) {
        FINISH((partial[i] + last[i]) * reciprocal)
    } else {
        FINISH((partial[i] + last[i]) / divisor)
    }
#undef FINISH
    return bad == 0;
}

/* out = the rows' sum in their order, divided by divisor; whether every element is finite. One or two rows:
 * one pass. More: in chunks that stay in the L1 cache, the rows but the last summed into out, then the last
 * added and the quotient taken in the chunk's final pass. */
CLONES static int mean_into(float *out, const float **rows, Py_ssize_t count, Py_ssize_t numel, float divisor) {
    int exponent;
    int power_of_two = frexpf(divisor, &exponent) == 0.5f && exponent > -120 && exponent < 120;
    if (count <= 2)
        return finish_mean(out, count == 2 ? rows[0] : NULL, rows[count - 1], (size_t)numel, divisor,
                           power_of_two);
    int finite = 1;
    for (Py_ssize_t start = 0; start < numel; start += MEAN_CHUNK) {
        size_t n = (size_t)(numel - start < MEAN_CHUNK ? numel - start : MEAN_CHUNK);
        float *sum = out + start;
        const float *first = rows[0] + start, *second = rows[1] + start;
        for (size_t i = 0; i < n; i++)
            sum[i] = first[i] + second[i];
        for (Py_ssize_t w = 2; w < count - 1; w++) {
            const float *row = rows[w] + start;
            for (size_t i = 0; i < n; i++)
                sum[i] = sum[i] + row[i];
        }
        finite &= finish_mean(sum, sum, rows[count - 1] + start, n, divisor, power_of_two);
    }
    return finite;
}

static long long now_ms(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* recv_into(fd, target, start, timeout_ms, budget_ms, check_finite) -> (received, finite, state)
 *
 * Receive bytes start.. of the writable buffer target (those before start arrived in earlier calls), and
 * return how many came in this call; stop when they all arrived (state 0), when the peer closed the
 * connection (1), when nothing arrived for timeout_ms (2; < 0: wait forever), or when the call has run for
 * budget_ms (3, paused: the caller checks the sender's rate and calls again; < 0: no budget). With check_finite, the float32
 * elements completed by this call are checked as they arrive (one split by an earlier call's end included;
 * the buffer must then be 4-byte aligned); finite is False when one is not. A failed recv or poll raises OSError. The GIL is released throughout. */
static PyObject *recv_into(PyObject *self, PyObject *args) {
    int fd, timeout_ms, budget_ms, check_finite;
    Py_buffer target;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "iw*niip", &fd, &target, &start, &timeout_ms, &budget_ms, &check_finite))
        return NULL;
    if (start < 0 || target.len < start || fd < 0) {
        PyBuffer_Release(&target);
        PyErr_SetString(PyExc_ValueError, "recv_into: a start outside the target's bytes, or a negative descriptor");
        return NULL;
    }
    if (check_finite && (uintptr_t)target.buf % sizeof(float) != 0) {
        PyBuffer_Release(&target);
        PyErr_SetString(PyExc_ValueError, "recv_into: float32 elements at an unaligned address");
        return NULL;
    }
    char *base = (char *)target.buf;
    size_t got = (size_t)start, checked = got - got % sizeof(float), want = (size_t)target.len;
    int finite = 1, state = RECV_DONE, failure = 0;
    Py_BEGIN_ALLOW_THREADS
    long long until = budget_ms >= 0 ? now_ms() + budget_ms : -1;
    while (got < want) {
        size_t ask = want - got < RECV_CHUNK ? want - got : RECV_CHUNK;
        ssize_t count = recv(fd, base + got, ask, 0);
        if (count > 0) {
            got += (size_t)count;
            if (check_finite) {
                size_t whole = got - got % sizeof(float);
                if (whole > checked) {
                    finite &= floats_finite((const float *)(base + checked), (whole - checked) / sizeof(float));
                    checked = whole;
                }
            }
            continue;
        }
        if (count == 0) {
            state = RECV_CLOSED;
            break;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            failure = errno;
            break;
        }
        int wait_ms = timeout_ms, paused = 0;
        if (until >= 0) {
            long long left = until - now_ms();
            if (left <= 0) {
                state = RECV_PAUSED;
                break;
            }
            if (wait_ms < 0 || left < wait_ms) {
                wait_ms = (int)left;
                paused = 1;
            }
        }
        struct pollfd waiting = {fd, POLLIN, 0};
        int ready = poll(&waiting, 1, wait_ms);
        if (ready == 0) {
            state = paused ? RECV_PAUSED : RECV_TIMEOUT;
            break;
        }
        if (ready < 0 && errno != EINTR) {
            failure = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&target);
    if (failure) {
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(nOi)", (Py_ssize_t)got - start, finite ? Py_True : Py_False, state);
}

/* Receive exactly n bytes into buf, without the GIL (the caller released it): RECV_DONE, RECV_CLOSED (the peer
 * closed first) or RECV_TIMEOUT (nothing for timeout_ms; < 0: wait forever); -1 with *failure = errno when
 * recv or poll failed. *got counts the bytes received. */
static int recv_exact_nogil(int fd, char *buf, size_t n, size_t *got, int timeout_ms, int *failure) {
    while (*got < n) {
        ssize_t count = recv(fd, buf + *got, n - *got, 0);
        if (count > 0) {
            *got += (size_t)count;
            continue;
        }
        if (count == 0)
            return RECV_CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *failure = errno;
            return -1;
        }
        struct pollfd waiting = {fd, POLLIN, 0};
        int ready = poll(&waiting, 1, timeout_ms);
        if (ready == 0)
            return RECV_TIMEOUT;
        if (ready < 0 && errno != EINTR) {
            *failure = errno;
            return -1;
        }
    }
    return RECV_DONE;
}

/* recv_head(fd, head_size, length_at, small, timeout_ms) -> (state, data)
 *
 * A frame's head in one call, the GIL released throughout: head_size bytes (waiting for them), then, where the
 * little-endian u32 at offset length_at of them (the length of what follows the head) is at most small, as much
 * of what follows as has already arrived (never waiting for it: the caller checks the head before it waits for
 * more). data holds the bytes received; state as recv_into's: 0 the head came, 1 the peer closed before it
 * did (data: what came; empty when nothing did), 2 nothing for timeout_ms. A failed recv or poll raises
 * OSError. */
static PyObject *recv_head(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    Py_ssize_t head_size, length_at, small;
    if (!PyArg_ParseTuple(args, "innni", &fd, &head_size, &length_at, &small, &timeout_ms))
        return NULL;
    if (fd < 0 || head_size < 4 || length_at < 0 || length_at + 4 > head_size || small < 0 || small > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError, "recv_head: a negative descriptor, or a length outside the head");
        return NULL;
    }
    char *buf = PyMem_Malloc((size_t)(head_size + small));
    if (buf == NULL)
        return PyErr_NoMemory();
    size_t got = 0, want = (size_t)head_size;
    int state, failure = 0;
    Py_BEGIN_ALLOW_THREADS
    state = recv_exact_nogil(fd, buf, want, &got, timeout_ms, &failure);
    if (state == RECV_DONE) {
        const unsigned char *at = (const unsigned char *)buf + length_at;
        uint32_t follows = (uint32_t)at[0] | (uint32_t)at[1] << 8 | (uint32_t)at[2] << 16 | (uint32_t)at[3] << 24;
        if (follows <= (uint64_t)small) {
            want += follows;
            ssize_t count;
            while (got < want && (count = recv(fd, buf + got, want - got, MSG_DONTWAIT)) > 0)
                got += (size_t)count;
        }
    }
    Py_END_ALLOW_THREADS
    if (state < 0) {
        PyMem_Free(buf);
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *result = Py_BuildValue("(iy#)", state, buf, (Py_ssize_t)got);
    PyMem_Free(buf);
    return result;
}

/* send_parts(fd, parts, timeout_ms) -> (sent, state)
 *
 * Write the buffers of the sequence parts (at most MAX_PARTS), in order, from their own memory with gathered
 * writes (sendmsg), the GIL released for the whole transfer: state 0 when all were sent, 2 when they were not
 * within timeout_ms (< 0: no limit; as a socket's timeout bounds its sendall); sent counts the bytes written.
 * A failed sendmsg or poll raises OSError (a peer gone: BrokenPipeError or ConnectionResetError). */
#define MAX_PARTS 64
static PyObject *send_parts(PyObject *self, PyObject *args) {
    int fd, timeout_ms;
    PyObject *parts_arg;
    if (!PyArg_ParseTuple(args, "iOi", &fd, &parts_arg, &timeout_ms))
        return NULL;
    PyObject *parts_seq = PySequence_Fast(parts_arg, "send_parts: parts must be a sequence of buffers");
    if (parts_seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(parts_seq);
    if (fd < 0 || count > MAX_PARTS) {
        Py_DECREF(parts_seq);
        PyErr_Format(PyExc_ValueError, "send_parts: a negative descriptor, or more than %d parts", MAX_PARTS);
        return NULL;
    }
    Py_buffer views[MAX_PARTS];
    struct iovec iov[MAX_PARTS];
    Py_ssize_t held = 0;
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(parts_seq, held), &views[held], PyBUF_SIMPLE) < 0)
            break;
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    if (held < count) {
        for (Py_ssize_t i = 0; i < held; i++)
            PyBuffer_Release(&views[i]);
        Py_DECREF(parts_seq);
        return NULL;
    }
    size_t sent = 0;
    int state = RECV_DONE, failure = 0;
    Py_BEGIN_ALLOW_THREADS
    long long until = timeout_ms >= 0 ? now_ms() + timeout_ms : -1;
    struct iovec *next = iov;
    int left = (int)count;
    while (left > 0 && next->iov_len == 0) {
        next++;
        left--;
    }
    while (left > 0) {
        struct msghdr message;
        memset(&message, 0, sizeof(message));
        message.msg_iov = next;
        message.msg_iovlen = (size_t)left;
        ssize_t wrote = sendmsg(fd, &message, MSG_NOSIGNAL);
        if (wrote > 0) {
            sent += (size_t)wrote;
            size_t done = (size_t)wrote;
            while (left > 0 && done >= next->iov_len) {
                done -= next->iov_len;
                next++;
                left--;
            }
            if (left > 0) {
                next->iov_base = (char *)next->iov_base + done;
                next->iov_len -= done;
            }
            continue;
        }
        if (wrote < 0 && errno == EINTR)
            continue;
        if (wrote < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
            failure = errno;
            break;
        }
        int wait_ms = -1;
        if (until >= 0) {
            long long remaining = until - now_ms();
            if (remaining <= 0) {
                state = RECV_TIMEOUT;
                break;
            }
            wait_ms = (int)remaining;
        }
        struct pollfd waiting = {fd, POLLOUT, 0};
        int ready = poll(&waiting, 1, wait_ms);
        if (ready == 0) {
            state = RECV_TIMEOUT;
            break;
        }
        if (ready < 0 && errno != EINTR) {
            failure = errno;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
    Py_DECREF(parts_seq);
    if (failure) {
        errno = failure;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(ni)", (Py_ssize_t)sent, state);
}

/* mean_rows(out, rows, numel, divisor) -> finite
 *
 * out[i] = (((rows[0][i] + rows[1][i]) + rows[2][i]) + ...) / divisor in float32, each operation rounded once:
 * what torch.add(rows[0], rows[1], out=out), out.add_(row) for the others, then out.div_(divisor) make, in
 * one pass over the rows instead of one per operation. Returns whether every element of out is finite. */
/* The float32 rows a sequence of addresses names, at most most of them (PyMem_Free them); NULL with an
 * exception set. */
static const float **parsed_rows(PyObject *rows_arg, Py_ssize_t *count, const char *what, Py_ssize_t most) {
    PyObject *rows_seq = PySequence_Fast(rows_arg, "rows must be a sequence of addresses");
    if (rows_seq == NULL)
        return NULL;
    *count = PySequence_Fast_GET_SIZE(rows_seq);
    if (*count < 1 || *count > most) {
        Py_DECREF(rows_seq);
        PyErr_Format(PyExc_ValueError, "%s: 1 to %zd rows", what, most);
        return NULL;
    }
    const float **rows = PyMem_Malloc(sizeof(float *) * (size_t)*count);
    if (rows == NULL) {
        Py_DECREF(rows_seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t w = 0; w < *count; w++) {
        unsigned long long address = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(rows_seq, w));
        if (PyErr_Occurred()) {
            PyMem_Free(rows);
            Py_DECREF(rows_seq);
            return NULL;
        }
        rows[w] = (const float *)(uintptr_t)address;
    }
    Py_DECREF(rows_seq);
    return rows;
}

/* mean_rows(out, rows, numel, divisor) -> finite
 *
 * out[i] = (((rows[0][i] + rows[1][i]) + rows[2][i]) + ...) / divisor in float32, each operation rounded once:
 * what torch.add(rows[0], rows[1], out=out), out.add_(row) for the others, then out.div_(divisor) make, in
 * one pass over the rows instead of one per operation. Returns whether every element of out is finite. */
static PyObject *mean_rows(PyObject *self, PyObject *args) {
    unsigned long long out_address;
    PyObject *rows_arg;
    Py_ssize_t numel, count;
    float divisor;
    if (!PyArg_ParseTuple(args, "KOnf", &out_address, &rows_arg, &numel, &divisor))
        return NULL;
    if (numel < 0) {
        PyErr_SetString(PyExc_ValueError, "mean_rows: a negative length");
        return NULL;
    }
    const float **rows = parsed_rows(rows_arg, &count, "mean_rows", MAX_ROWS);
    if (rows == NULL)
        return NULL;
    float *out = (float *)(uintptr_t)out_address;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = mean_into(out, rows, count, numel, divisor);
    Py_END_ALLOW_THREADS
    PyMem_Free(rows);
    return PyBool_FromLong(finite);
}

/* The SGD step of torch.optim.SGD's single-tensor path, on the mean of the rows, element by element: each
 * "a.add_(b, alpha=x)" of torch is a fused multiply-add there (its vector kernels' fmadd: fmaf here, one
 * rounding) and each "a.mul_(x)" a product; the caller checks once per variant that this gives torch's bits on
 * this machine (imerge/core/native.py) before it uses it. */
typedef struct {
    float neg_lr, weight_decay, momentum, one_minus_dampening;
    int nesterov;
} SgdHypers;

CLONES static int sgd_into(const float *param, const float **rows, Py_ssize_t count, Py_ssize_t numel,
                           float divisor, SgdHypers h, float *buf, float *out) {
    float mean[MEAN_CHUNK];
    const float *shifted[MAX_SMALL_ROWS];
    int finite = 1;
    for (Py_ssize_t start = 0; start < numel; start += MEAN_CHUNK) {
        Py_ssize_t n = numel - start < MEAN_CHUNK ? numel - start : MEAN_CHUNK;
        for (Py_ssize_t w = 0; w < count; w++)
            shifted[w] = rows[w] + start;
        finite &= mean_into(mean, shifted, count, n, divisor);
        const float *p = param + start;
        float *b = buf ? buf + start : NULL, *next = out + start;
        for (Py_ssize_t i = 0; i < n; i++) {
            float grad = mean[i];
            if (h.weight_decay != 0.0f)
                grad = fmaf(p[i], h.weight_decay, grad);
            if (b != NULL) {
                float kept = b[i] * h.momentum;
                kept = fmaf(grad, h.one_minus_dampening, kept);
                b[i] = kept;
                grad = h.nesterov ? fmaf(kept, h.momentum, grad) : kept;
            }
            next[i] = fmaf(grad, h.neg_lr, p[i]);
        }
    }
    return finite;
}

/* sgd_step(param, rows, numel, divisor, neg_lr, weight_decay, momentum, one_minus_dampening, nesterov, buf,
 *          out) -> finite
 *
 * One pass over a piece: the rows' mean (as mean_rows makes it), then SGD's update of param (and of the
 * momentum buffer buf, 0 without momentum), the new parameters written to out (param is only read; out may be
 * param itself: in place). Returns whether the mean was finite. The GIL is released throughout. */
static PyObject *sgd_step(PyObject *self, PyObject *args) {
    unsigned long long param_address, buf_address, out_address;
    PyObject *rows_arg;
    Py_ssize_t numel, count;
    float divisor;
    SgdHypers h;
    if (!PyArg_ParseTuple(args, "KOnfffffpKK", &param_address, &rows_arg, &numel, &divisor, &h.neg_lr,
                          &h.weight_decay, &h.momentum, &h.one_minus_dampening, &h.nesterov, &buf_address,
                          &out_address))
        return NULL;
    if (out_address == 0) {
        PyErr_SetString(PyExc_ValueError, "sgd_step: no place for the new parameters");
        return NULL;
    }
    if (numel < 0) {
        PyErr_SetString(PyExc_ValueError, "sgd_step: a negative length");
        return NULL;
    }
    const float **rows = parsed_rows(rows_arg, &count, "sgd_step", MAX_SMALL_ROWS);
    if (rows == NULL)
        return NULL;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = sgd_into((const float *)(uintptr_t)param_address, rows, count, numel, divisor, h,
                      (float *)(uintptr_t)buf_address, (float *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    PyMem_Free(rows);
    return PyBool_FromLong(finite);
}

/* Adam's moments on the rows' mean, torch.optim.Adam's (and AdamW's) single-tensor order: the weight decay
 * (AdamW: param.mul_(decay_mul) first; Adam: grad.add(param, alpha=weight_decay)), exp_avg.lerp_(grad, w1),
 * exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=omb2), as torch's vector kernels round them (lerp and
 * addcmul fused multiply-adds). With AdamW's decay the decayed parameters go to out (param is only read).
 * The square root is torch's own (its vector library's rounding); then adam_update. The caller probes each
 * variant against torch first (imerge/core/native.py). */
CLONES static int adam_moments_into(const float *param, const float **rows, Py_ssize_t count, Py_ssize_t numel,
                                    float divisor, float weight_decay, float decay_mul, float w1, float beta2,
                                    float omb2, float *exp_avg, float *exp_avg_sq, float *out) {
    float mean[MEAN_CHUNK];
    const float *shifted[MAX_SMALL_ROWS];
    int finite = 1;
    for (Py_ssize_t start = 0; start < numel; start += MEAN_CHUNK) {
        Py_ssize_t n = numel - start < MEAN_CHUNK ? numel - start : MEAN_CHUNK;
        for (Py_ssize_t w = 0; w < count; w++)
            shifted[w] = rows[w] + start;
        finite &= mean_into(mean, shifted, count, n, divisor);
        const float *p = param + start;
        float *m = exp_avg + start, *v = exp_avg_sq + start, *decayed = out + start;
        /* one loop per kind of decay, so that each stays a plain vector loop */
#define MOMENTS(decay)                                                                                        \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                  \
            float grad = mean[i];                                                                             \
            decay;                                                                                            \
            float difference = grad - m[i];                                                                   \
            m[i] = fabsf(w1) < 0.5f ? fmaf(w1, difference, m[i]) : fmaf(w1 - 1.0f, difference, grad);       \
            v[i] = fmaf(omb2 * grad, grad, v[i] * beta2);                                                     \
        }
        if (decay_mul != 0.0f) {
            MOMENTS(decayed[i] = p[i] * decay_mul)
        } else if (weight_decay != 0.0f) {
            MOMENTS(grad = fmaf(p[i], weight_decay, grad))
        } else {
            MOMENTS((void)0)
        }
#undef MOMENTS
    }
    return finite;
}

/* out = param + (neg_step * exp_avg) / (root / bc2_sqrt + eps), as torch's div, add_ and addcdiv_ round them
 * (out may be param: in place). root: torch's exp_avg_sq.sqrt(). */
CLONES static void adam_update_into(const float *param, const float *exp_avg, const float *root, Py_ssize_t numel,
                                    float bc2_sqrt, float eps, float neg_step, float *out) {
    for (Py_ssize_t i = 0; i < numel; i++) {
        float denom = root[i] / bc2_sqrt + eps;
        out[i] = param[i] + (neg_step * exp_avg[i]) / denom;
    }
}

/* adam_moments(param, rows, numel, divisor, weight_decay, decay_mul, w1, beta2, omb2, exp_avg, exp_avg_sq,
 *              out) -> finite (of the mean) */
static PyObject *adam_moments(PyObject *self, PyObject *args) {
    unsigned long long param_address, exp_avg_address, exp_avg_sq_address, out_address;
    PyObject *rows_arg;
    Py_ssize_t numel, count;
    float divisor, weight_decay, decay_mul, w1, beta2, omb2;
    if (!PyArg_ParseTuple(args, "KOnffffffKKK", &param_address, &rows_arg, &numel, &divisor, &weight_decay,
                          &decay_mul, &w1, &beta2, &omb2, &exp_avg_address, &exp_avg_sq_address, &out_address))
        return NULL;
    if (out_address == 0) {
        PyErr_SetString(PyExc_ValueError, "adam_moments: no place for the decayed parameters");
        return NULL;
    }
    if (numel < 0) {
        PyErr_SetString(PyExc_ValueError, "adam_moments: a negative length");
        return NULL;
    }
    const float **rows = parsed_rows(rows_arg, &count, "adam_moments", MAX_SMALL_ROWS);
    if (rows == NULL)
        return NULL;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = adam_moments_into((const float *)(uintptr_t)param_address, rows, count, numel, divisor, weight_decay,
                               decay_mul, w1, beta2, omb2, (float *)(uintptr_t)exp_avg_address,
                               (float *)(uintptr_t)exp_avg_sq_address, (float *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    PyMem_Free(rows);
    return PyBool_FromLong(finite);
}

/* adam_update(param, exp_avg, root, numel, bc2_sqrt, eps, neg_step, out) */
static PyObject *adam_update(PyObject *self, PyObject *args) {
    unsigned long long param_address, exp_avg_address, root_address, out_address;
    Py_ssize_t numel;
    float bc2_sqrt, eps, neg_step;
    if (!PyArg_ParseTuple(args, "KKKnfffK", &param_address, &exp_avg_address, &root_address, &numel, &bc2_sqrt,
                          &eps, &neg_step, &out_address))
        return NULL;
    if (out_address == 0) {
        PyErr_SetString(PyExc_ValueError, "adam_update: no place for the new parameters");
        return NULL;
    }
    if (numel < 0) {
        PyErr_SetString(PyExc_ValueError, "adam_update: a negative length");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    adam_update_into((const float *)(uintptr_t)param_address, (const float *)(uintptr_t)exp_avg_address,
                     (const float *)(uintptr_t)root_address, numel, bc2_sqrt, eps, neg_step,
                     (float *)(uintptr_t)out_address);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* The (address, numel) of a run of float32 elements, as all_finite and sum_squares take it; 0 with an exception
 * set where the arguments are not that. */
static int parsed_floats(PyObject *args, const char *what, const float **floats, size_t *numel) {
    unsigned long long address;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "Kn", &address, &count))
        return 0;
    if (count < 0) {
        PyErr_Format(PyExc_ValueError, "%s: negative length", what);
        return 0;
    }
    *floats = (const float *)(uintptr_t)address;
    *numel = (size_t)count;
    return 1;
}

/* all_finite(address, numel) -> whether the numel float32 elements at address are all finite (GIL released). */
static PyObject *all_finite(PyObject *self, PyObject *args) {
    const float *floats;
    size_t numel;
    if (!parsed_floats(args, "all_finite", &floats, &numel))
        return NULL;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = floats_finite(floats, numel);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(finite);
}

/* The sum of the squares of n floats in double precision, in a fixed order whatever the vector width: eight
 * running sums (element i into sum i mod 8; the tail into the first), added pairwise at the end. */
CLONES static double squares_sum(const float *p, size_t n) {
    double sums[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) {
            double value = (double)p[i + (size_t)k];
            sums[k] += value * value;
        }
    for (; i < n; i++) {
        double value = (double)p[i];
        sums[0] += value * value;
    }
    return ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
}

/* sum_squares(address, numel) -> float: what a round's clipping needs of its mean, in one pass (GIL released) */
static PyObject *sum_squares(PyObject *self, PyObject *args) {
    const float *floats;
    size_t numel;
    if (!parsed_floats(args, "sum_squares", &floats, &numel))
        return NULL;
    double total;
    Py_BEGIN_ALLOW_THREADS
    total = squares_sum(floats, numel);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(total);
}

static PyMethodDef methods[] = {
    {"recv_into", recv_into, METH_VARARGS, "recv_into(fd, target, start, timeout_ms, budget_ms, check_finite) -> "
                                           "(received, finite, state): 0 done, 1 closed, 2 timed out, 3 paused"},
    {"send_parts", send_parts, METH_VARARGS, "send_parts(fd, parts, timeout_ms) -> (sent, state): 0 done, 2 timed out"},
    {"recv_head", recv_head, METH_VARARGS, "recv_head(fd, head_size, length_at, small, timeout_ms) -> (state, data)"},
    {"mean_rows", mean_rows, METH_VARARGS, "mean_rows(out, rows, numel, divisor) -> finite"},
    {"adam_moments", adam_moments, METH_VARARGS, "adam_moments(param, rows, numel, divisor, weight_decay, "
                                                 "decay_mul, w1, beta2, omb2, exp_avg, exp_avg_sq, out) -> finite"},
    {"adam_update", adam_update, METH_VARARGS, "adam_update(param, exp_avg, root, numel, bc2_sqrt, eps, neg_step, "
                                               "out)"},
    {"sgd_step", sgd_step, METH_VARARGS, "sgd_step(param, rows, numel, divisor, neg_lr, weight_decay, momentum, "
                                         "one_minus_dampening, nesterov, buf, out) -> finite"},
    {"all_finite", all_finite, METH_VARARGS, "all_finite(address, numel) -> bool"},
    {"sum_squares", sum_squares, METH_VARARGS, "sum_squares(address, numel) -> float (double precision)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "imerge.core._native",
                                    "IMerge's data plane in C: receive, check and sum float32 bytes with the GIL "
                                    "released.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "RECV_DONE", RECV_DONE) < 0 ||
        PyModule_AddIntConstant(m, "RECV_CLOSED", RECV_CLOSED) < 0 ||
        PyModule_AddIntConstant(m, "RECV_TIMEOUT", RECV_TIMEOUT) < 0 ||
        PyModule_AddIntConstant(m, "RECV_PAUSED", RECV_PAUSED) < 0 ||
        PyModule_AddIntConstant(m, "RECV_CHUNK", RECV_CHUNK) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
