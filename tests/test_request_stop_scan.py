"""RequestState's stop-string search: each append searches only the new text and the last
holdback characters before it, whether or not deltas advance `emitted` (generate()'s own requests
take none), and a stop string split over tokens is still found and cut."""
from metrale.request import RequestState
from metrale.sampling.params import SamplingParams
from metrale.scheduler.sequence import Sequence


class _Decoder:
    def feed(self, t):
        return chr(ord("a") + t % 26) if t < 100 else "STOP"[t - 100]

    def flush(self):
        return ""


class _Tok:
    vocab_size = 200

    def incremental_decoder(self, prompt_ids=(), skip_special_tokens=True):
        return _Decoder()


def _state(output_only: bool, **kw):
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, stop=["STOP"], **kw)
    return RequestState(Sequence([1, 2], params), _Tok(), (), 100_000, text_at_end=output_only)


def test_stop_string_search_is_incremental_without_deltas():
    for output_only in (True, False):
        st = _state(output_only)
        for i in range(500):
            assert len(st.text) + 1 - max(0, st._scanned - st.holdback) <= st.holdback + 1   # the next window
            assert st.append(i % 26) is None
            if not output_only:
                st.delta(None)
        assert st._scanned == len(st.text) == 500
        reasons = [st.append(100 + j) for j in range(4)]          # "STOP" over four tokens
        assert reasons == [None, None, None, "stop"], reasons
        assert st.text == "".join(chr(ord("a") + i % 26) for i in range(500)), output_only
        assert st.stop_reason == "STOP"
