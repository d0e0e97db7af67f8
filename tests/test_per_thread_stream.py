"""The per-thread default stream handle (2: CU_STREAM_PER_THREAD, CuPy's ``Stream.ptds``) names a
different stream in each thread, which vmalloc, keying streams by handle, cannot tell apart
(README, "What does not work with a pluggable allocator"). Used from one thread it is a stream
like any other; from a second thread the allocator says so on stderr, once: memory freed in
one thread could otherwise be reused in another before the first thread's work is done, with
nothing said."""
import threading

from vmalloc import Allocator

PER_THREAD = 2
WARNING = "per-thread default stream handle"


def use(a: Allocator, nbytes: int) -> None:
    a.free(a.malloc(nbytes, stream=PER_THREAD))


def in_thread(fn) -> None:
    t = threading.Thread(target=fn)
    t.start()
    t.join()


def test_one_thread_is_quiet(capfd):
    a = Allocator("host", chunk_size=64 << 10)
    for n in (100, 1 << 20, 100):
        use(a, n)
    a.close()
    assert WARNING not in capfd.readouterr().err


def test_a_second_thread_is_said_once_per_allocator(capfd):
    a = Allocator("host", chunk_size=64 << 10)
    use(a, 100)
    for n in (100, 1 << 20):                # small block and range: both go through malloc
        in_thread(lambda: use(a, n))
    err = capfd.readouterr().err
    assert err.count(WARNING) == 1, err
    assert "explicit streams" in err
    b = Allocator("host", chunk_size=64 << 10)   # another allocator says it again
    in_thread(lambda: use(b, 100))
    use(b, 100)
    assert capfd.readouterr().err.count(WARNING) == 1
    a.close()
    b.close()


def test_other_streams_from_several_threads_are_quiet(capfd):
    a = Allocator("host", chunk_size=64 << 10)
    for s in (0, 7):
        in_thread(lambda: a.free(a.malloc(100, stream=s)))
        a.free(a.malloc(100, stream=s))
    a.close()
    assert WARNING not in capfd.readouterr().err
