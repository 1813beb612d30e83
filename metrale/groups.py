"""Requests with n > 1 or best_of > 1: one child request per candidate (`f"{id}-{j}"`, seeds from
sampling/fanout.py), gathered back into one RequestOutput with the n chosen completions. With
best_of > n the candidates are not streamed: their deltas are dropped and the n chosen
completions come whole when the last candidate ends (docs/sampling.md, "n > 1 and best_of")."""
from __future__ import annotations

import dataclasses

from metrale.outputs import RequestOutput, StreamDelta
from metrale.sampling import fanout
from metrale.sampling.params import SamplingParams


@dataclasses.dataclass
class Group:
    request_id: str
    params: SamplingParams
    children: list[str]
    hidden: bool                                   # best_of > n: candidates are not streamed
    outputs: dict[str, RequestOutput] = dataclasses.field(default_factory=dict)   # finished children


class FanoutGroups:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.hidden: set[str] = set()              # candidate ids whose deltas route() drops
        self._outbox: list[StreamDelta] = []       # completions of finished hidden groups

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def get(self, request_id: str) -> Group | None:
        return self.groups.get(request_id)

    def child_ids(self) -> set[str]:
        return {c for g in self.groups.values() for c in g.children}

    def open(self, request_id: str, params: SamplingParams, children: list[str], states: list) -> Group:
        """Registers a group; its children's states carry the group and their index."""
        group = self.groups[request_id] = Group(request_id, params, children, hidden=len(children) > params.n)
        for j, st in enumerate(states):
            st.group, st.index = request_id, j
            if group.hidden:
                self.hidden.add(st.public_id)
            else:
                st.public_id = request_id
        return group

    def child_finished(self, group_id: str, child_id: str, output: RequestOutput) -> RequestOutput | None:
        """Records a finished child; the parent's output once the last child finished."""
        group = self.groups[group_id]
        group.outputs[child_id] = output
        if len(group.outputs) < len(group.children):
            return None
        del self.groups[group_id]
        outs = [group.outputs[c] for c in group.children]
        leader = outs[0]                       # it computed the whole prompt
        chosen = [dataclasses.replace(o, index=i, prompt_logprobs=leader.prompt_logprobs)
                  for i, o in enumerate(fanout.select(outs, group.params))]
        metrics = {"time_to_first_token": min(o.metrics["time_to_first_token"] for o in outs),
                   "latency": max(o.metrics["latency"] for o in outs),
                   "num_preemptions": sum(o.metrics["num_preemptions"] for o in outs),
                   "num_generated_tokens": sum(len(o.token_ids) for o in outs)}
        parent = dataclasses.replace(chosen[0], request_id=group.request_id, metrics=metrics)
        parent.outputs = chosen
        if group.hidden:
            self._outbox.extend(StreamDelta(group.request_id, o.text, o.token_ids, o.finish_reason, o.index,
                                            o.logprobs, o.stop_reason) for o in chosen)
        return parent

    def route(self, deltas: list[StreamDelta]) -> list[StreamDelta]:
        """The deltas callers see: hidden candidates' dropped, finished hidden groups' added."""
        out = []
        for d in deltas:
            if d.request_id in self.hidden:
                if d.finished:
                    self.hidden.discard(d.request_id)
                continue
            out.append(d)
        if self._outbox:
            out.extend(self._outbox)
            self._outbox = []
        return out
