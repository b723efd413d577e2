"""The dispatcher's pump: the order window, shard assignment, step filling, planning, sending.

Split from the socket handling in server.py: everything here runs after each poll on state the
server owns (one thread, no locks), and decides what may move next under the memory bounds:
open shards within the reorder window, consume samples in the global order, plan and journal
a step only while fewer than `max_retained_steps` await acknowledgement, and grant readers
credits only within `max_buffered_samples` / `max_buffered_bytes`.
"""

from __future__ import annotations

import time

from dispatcher_server import protocol as P
from dispatcher_server.batching import build_batch, rank_message
from dispatcher_server.journal import StepEntry, pack_cursor
from dispatcher_server.metrics import event
from dispatcher_server.peers import Assignment, RetainedStep, ShardProgress
from dispatcher_server.planner import plan_step
from dispatcher_server.planner.plan import StepPlan
from dispatcher_server.steplog import plan_record


class Pump:
    """Mixin of `Dispatcher`: the per-iteration flow of shards, samples, steps and credits."""

    def _pump(self) -> None:
        self._open_window()
        self._assign()
        while True:
            self._fill()
            if not self._step_ready() or not self._may_plan():
                break
            self._plan()
        self._send_steps()
        self._evict()
        self._grant()

    def _window_end(self) -> int:
        base = self.cursor.base
        end = base + self.config.flow.num_inflight_shards
        # Deterministic mode takes positions in order, so the window may run on into the next
        # epoch (readers do not idle while an epoch's last shards drain; its samples wait in
        # their buffers, since steps never span epochs). Arrival mode plans in arrival order:
        # it opens an epoch only once the last one is consumed.
        if self.config.mode != "deterministic":
            end = min(end, self.order.epoch_end(base))
        return end if self.order.end is None else min(end, self.order.end)

    def _finished(self) -> bool:
        """No step will ever be planned again (data or step budget exhausted)."""
        if self.config.max_steps is not None and self.next_plan >= self.config.max_steps:
            return True
        return self.order.end is not None and self.cursor.base >= self.order.end and not self.acc

    def _open_window(self) -> None:
        if self._finished():
            return
        for pos in range(self.cursor.base, self._window_end()):
            if pos not in self.progress and self.cursor.is_open(pos):
                start = self.cursor.start_index(pos)
                self.progress[pos] = ShardProgress(pos=pos, url=self.order.url(pos),
                                                   next_index=start)

    def _assign(self) -> None:
        """Lowest free positions first, each to the ready reader holding the fewest shards (so
        every reader has one to read before any gets one queued behind it)."""
        free = [r for r in self.readers.values() if r.ready and len(r.assignments) < r.slots]
        if not free:
            self._preempt()
            return
        todo = sorted(p for p, pr in self.progress.items() if pr.assignment is None and not pr.reader_done)
        for pos in todo:
            if not free:
                break
            reader = min(free, key=lambda r: len(r.assignments))
            prog = self.progress[pos]
            a = Assignment(id=self._next_assign, pos=pos, reader=reader.ident)
            self._next_assign += 1
            prog.assignment = a.id
            reader.assignments.append(a)
            if len(reader.assignments) >= reader.slots:
                free.remove(reader)
            self.assignments[a.id] = a
            self._send_reader(reader, P.SHARD_ASSIGN, assign_id=a.id, shard=prog.url, pos=pos,
                              epoch=self.order.epoch_of(pos), start_index=prog.next_index)
            event("shard_assigned", shard=prog.url, pos=pos, start=prog.next_index,
                  reader=reader.name)

    def _preempt(self) -> None:
        """A lost reader's shard may sit below shards others hold at their credit cap, and only
        lower positions drain: cancel the highest assignment so its reader takes the lower one."""
        if any(len(r.assignments) < r.slots for r in self.readers.values()):
            return  # a reader has a free slot already: it gets the lowest once ready
        todo = [p for p, pr in self.progress.items() if pr.assignment is None and not pr.reader_done]
        if not todo or not self.assignments:
            return
        a = max(self.assignments.values(), key=lambda a: a.pos)
        reader = self.readers.get(a.reader)
        if a.pos < min(todo) or reader is None:
            return
        self._take_back(reader, a)
        event("shard_preempted", shard=self.order.url(a.pos), pos=a.pos, reader=reader.name)

    def _acc_epoch_end(self) -> int:
        return self.order.epoch_end(self.acc[0].pos)

    def _take(self, prog: ShardProgress, limit: int) -> int:
        """Move up to `limit` head samples of `prog` into the step being filled, as one block;
        how many moved (0 if the head must wait).

        The block shares one position, hence one epoch, so only its head is checked against the
        step's epoch; the token budget is checked sample by sample and cuts the step where the
        next sample would exceed it, exactly as taking one sample at a time would.
        """
        buf = prog.buffer
        head = buf[0]
        budget = self.config.batch.token_budget
        tokens = self.acc_tokens
        if self.acc:
            if budget is not None and tokens + head.llm_len > budget:
                self.acc_cut = True
                return 0
            if self.order.epoch_of(head.pos) != self.order.epoch_of(self.acc[0].pos):
                return 0  # steps never span epochs
        n = min(limit, len(buf))
        if budget is not None:
            fits = 0
            for s in buf:
                if fits == n:
                    break
                if (fits or self.acc) and tokens + s.llm_len > budget:
                    self.acc_cut = True
                    break
                tokens += s.llm_len
                fits += 1
            n = fits
        if n == len(buf):
            taken = list(buf)
            buf.clear()
        else:
            taken = [buf.popleft() for _ in range(n)]
        if budget is None:
            tokens += sum(s.llm_len for s in taken)
        nbytes = sum(s.nbytes for s in taken)
        prog.nbytes -= nbytes
        self.cursor.consume(head.pos, taken[-1].index)
        self.acc.extend(taken)
        self.acc_tokens = tokens
        self.acc_bytes += nbytes
        return n

    def _finish_drained(self) -> None:
        for pos in [p for p, pr in self.progress.items() if pr.reader_done and not pr.buffer]:
            del self.progress[pos]
            self.cursor.finish(pos)

    def _fill(self) -> None:
        G = self.config.batch.global_batch
        deterministic = self.config.mode == "deterministic"
        while len(self.acc) < G and not self.acc_cut:
            self._finish_drained()
            if deterministic:
                prog = self.progress.get(self.cursor.base)
                if prog is None or not prog.buffer or not self._take(prog, G - len(self.acc)):
                    return
            else:
                if not self.arrival:
                    return
                run = self.arrival[0]  # [pos, count]: that many of pos's buffer, in order
                moved = self._take(self.progress[run[0]], min(G - len(self.acc), run[1]))
                if not moved:
                    return
                run[1] -= moved
                if not run[1]:
                    self.arrival.popleft()
        self._finish_drained()

    def _step_ready(self) -> bool:
        if not self.acc:
            return False
        if len(self.acc) >= self.config.batch.global_batch or self.acc_cut:
            return True
        # The epoch's positions are all consumed: its last, smaller step goes out now.
        return self.cursor.base >= self._acc_epoch_end()

    def _may_plan(self) -> bool:
        if self.config.max_steps is not None and self.next_plan >= self.config.max_steps:
            return False
        return len(self.retained) < self.config.flow.max_retained_steps

    def _plan(self) -> None:
        step, batch = self.next_plan, build_batch(self.acc)
        epoch = self.order.epoch_of(self.acc[0].pos)
        digest = batch.digest()
        t0 = time.perf_counter()
        replay = self.replay.pop(step, None)
        verbatim = replay is not None and replay.digest == digest
        if verbatim:
            plan = StepPlan.from_dict(replay.plan)
        else:
            if replay is not None and self.config.mode == "deterministic":
                self.metrics.error("replay_mismatch", step=step,
                                   detail="samples differ from the journal; shards changed on disk?")
            plan = plan_step(batch.inputs, self.topology, self.config.planner)
        plan_ms = (time.perf_counter() - t0) * 1e3
        cursor_after = self.cursor.to_wire()
        # A verbatim replay is already journaled: recording it again would supersede the
        # journaled steps after it, which ranks ahead of the others may be committing.
        if self.journal is None:
            self.cursors[step] = pack_cursor(cursor_after)
        elif not verbatim:
            self.journal.record_step(StepEntry(
                step=step, epoch=epoch, world_size=self.config.world_size, cursor_after=cursor_after,
                num_samples=len(batch.samples), digest=digest, plan=plan.to_dict()))
        self.retained.append(RetainedStep(step=step, epoch=epoch, batch=batch, plan=plan,
                                          messages=[None] * self.config.world_size,
                                          num_samples=len(batch.samples), nbytes=self.acc_bytes))
        self.acc, self.acc_tokens, self.acc_bytes, self.acc_cut = [], 0, 0, False
        self.next_plan = step + 1
        if self.step_log is not None:
            self.step_log.write(plan_record(step, plan, config=self.config.planner,
                                            plan_ms=plan_ms, epoch=epoch))
        m = self.metrics
        m.steps_served.inc()
        m.plan_ms.observe(plan_ms)
        for phase, value in plan.metrics.get("max_over_mean", {}).items():
            m.imbalance.labels(phase).set(value)
        event("step_planned", step=step, epoch=epoch, samples=len(batch.samples),
              microbatches=plan.num_microbatches, plan_ms=f"{plan_ms:.2f}",
              lb_ratio=f"{plan.metrics.get('step_time_over_lb', 0):.3f}")

    def _send_steps(self) -> None:
        first = self.retained[0].step if self.retained else self.next_plan
        for slot in self.slots:
            if slot.ident is None:
                continue
            while slot.next_send < slot.upto and first <= slot.next_send < self.next_plan:
                rs = self.retained[slot.next_send - first]
                if rs.messages[slot.rank] is None:
                    self._seq += 1
                    msg = rank_message(rs.batch, rs.plan, step=rs.step, epoch=rs.epoch,
                                       rank=slot.rank, seq=self._seq)
                    rs.messages[slot.rank] = msg
                    # The message copies its items' payloads into one frame per micro-batch and
                    # is kept until the step is evicted: it counts against max_buffered_bytes
                    # like the samples it came from, so credits shrink while it is held.
                    rs.nbytes += sum(memoryview(f).nbytes for f in msg)
                self._send_frames(self.trainer_sock, slot.ident, rs.messages[slot.rank], "trainer")
                slot.last_sent = time.monotonic()
                slot.next_send += 1
            if (self._finished() and slot.next_send >= self.next_plan and not slot.end_sent):
                reason = "max_steps" if self.config.max_steps is not None and \
                    self.next_plan >= self.config.max_steps else "max_epochs"
                self._send(self.trainer_sock, slot.ident, P.END, next_step=self.next_plan,
                           reason=reason)
                slot.end_sent = True

    def _evict(self) -> None:
        while self.retained and all(s.received > self.retained[0].step for s in self.slots):
            self.retained.popleft()

    def _grant(self) -> None:
        if self._finished() or not self.assignments:
            self._gauges()
            return
        f = self.config.flow
        held, held_bytes = self._gauges()
        outstanding = sum(a.credits for a in self.assignments.values())
        avg = self._bytes_seen / self._samples_seen if self._samples_seen else 0.0
        for a in sorted(self.assignments.values(), key=lambda a: a.pos):
            prog = self.progress[a.pos]
            room = min(self.config.shard_cap - len(prog.buffer) - a.credits,
                       f.max_buffered_samples - held - outstanding)
            starving = a.pos == self.cursor.base and not prog.buffer and not a.credits
            if avg > 0 and not starving:  # the head shard may never wait on bytes: no deadlock
                room = min(room, int((f.max_buffered_bytes - held_bytes) / avg) - outstanding)
            want = min(room, 2 * f.credit_batch - a.credits)
            if want <= 0 or (a.credits > 0 and want < f.credit_batch):
                continue
            a.credits += want
            outstanding += want
            reader = self.readers.get(a.reader)
            if reader is not None:
                self._send_reader(reader, P.CREDIT, assign_id=a.id, samples=want)

    def _gauges(self) -> tuple[int, int]:
        held = (sum(len(p.buffer) for p in self.progress.values()) + len(self.acc)
                + sum(rs.num_samples for rs in self.retained))
        held_bytes = (sum(p.nbytes for p in self.progress.values()) + self.acc_bytes
                      + sum(rs.nbytes for rs in self.retained))
        self.metrics.buffered_samples.set(held)
        self.metrics.buffered_bytes.set(held_bytes)
        self.metrics.retained_steps.set(len(self.retained))
        return held, held_bytes
