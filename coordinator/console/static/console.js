// The TunePlane console's script for every page: live updates of a Job page (its state, and
// its Retry button once it has ended), its log and the Jobs list from their server-sent events
// (/api/v1/.../events). The pages work without it (every action is a plain form; a reload
// shows the same); this only saves the reload. Each
// stream is the server's to bound (one read a second, ten minutes); a log stream is opened
// again from the offset already shown, so nothing is appended twice.
"use strict";

const ENDED = ["succeeded", "failed", "aborted", "cancelled"];

function followJob(holder) {
  const runId = holder.dataset.runId;
  const events = new EventSource("/api/v1/jobs/" + encodeURIComponent(runId) + "/events");
  let shown = null;
  events.addEventListener("job", (message) => {
    const job = JSON.parse(message.data);
    const state = document.getElementById("job-state");
    const reason = document.getElementById("job-state-reason");
    const attempts = JSON.stringify(job.attempts);
    if (shown !== null && shown !== attempts) {
      // Attempts or members changed: the server renders them again.
      window.location.reload();
      return;
    }
    shown = attempts;
    state.textContent = job.state;
    reason.textContent = job.state_reason;
    if (ENDED.includes(job.state)) {
      const form = document.getElementById("cancel-form");
      if (form) form.remove();
      // Rendered hidden while the Job ran, for who may retry it; shown once its state allows.
      const retry = document.getElementById("retry-form");
      if (retry && retry.dataset.shownIn && retry.dataset.shownIn.split(" ").includes(job.state)) {
        retry.hidden = false;
      }
      events.close();
    }
  });
}

function followLog(pre) {
  const status = document.getElementById("log-status");
  let at = Number(pre.dataset.nextOffset);
  let failures = 0;
  function open() {
    const q = new URLSearchParams({
      attempt: pre.dataset.attempt,
      member: pre.dataset.member,
      stream: pre.dataset.stream,
      from: String(at),
    });
    const url = "/api/v1/jobs/" + encodeURIComponent(pre.dataset.runId) + "/logs/events?" + q;
    const events = new EventSource(url);
    events.addEventListener("log", (message) => {
      failures = 0;
      const page = JSON.parse(message.data);
      page.pieces.forEach((piece) => {
        if (piece.dropped_before) pre.append("[" + piece.dropped_before + " bytes dropped here]\n");
        pre.append(piece.text);
      });
      at = page.next_offset;
      pre.dataset.nextOffset = String(at);
      if (page.complete) {
        pre.dataset.complete = "yes";
        status.textContent = "complete";
        events.close();
      }
    });
    events.onerror = () => {
      // The server ended the stream (its time is up), refused it or the connection broke: open
      // it again from what is shown, unless the log is complete; give up after a few tries in
      // a row that brought nothing (a refusal, say: a reload shows its sentence).
      events.close();
      failures += 1;
      if (pre.dataset.complete === "yes") return;
      if (failures < 5) setTimeout(open, 2000);
      else status.textContent = "not following: reload the page";
    };
  }
  open();
}

function cell(row, content) {
  const td = document.createElement("td");
  if (typeof content === "string") td.textContent = content;
  else td.append(content);
  row.append(td);
}

function utc(ms) {
  return ms ? new Date(ms).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "-";
}

function followJobs(holder) {
  const place = document.getElementById("jobs-table");
  const empty = place.dataset.empty;
  const query = holder.dataset.query;
  const events = new EventSource("/api/v1/jobs/events" + (query ? "?" + query : ""));
  events.addEventListener("jobs", (message) => {
    const jobs = JSON.parse(message.data).jobs;
    const caption = place.dataset.caption;
    if (!jobs.length) {
      const p = document.createElement("p");
      p.textContent = empty;
      place.replaceChildren(p);
      return;
    }
    const table = document.createElement("table");
    const cap = document.createElement("caption");
    cap.textContent = caption;
    table.append(cap);
    const thead = document.createElement("thead");
    const tr = document.createElement("tr");
    place.dataset.columns.split("|").forEach((name) => {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = name;
      tr.append(th);
    });
    thead.append(tr);
    table.append(thead);
    const body = document.createElement("tbody");
    jobs.forEach((job) => {
      const row = document.createElement("tr");
      const link = document.createElement("a");
      link.href = "/jobs/" + encodeURIComponent(job.run_id);
      link.textContent = job.run_id;
      cell(row, link);
      [job.project, job.experiment, job.owner].forEach((v) => cell(row, v));
      const state = document.createElement("span");
      state.className = "state";
      state.textContent = job.state;
      cell(row, state);
      cell(row, job.fleet);
      cell(row, utc(job.created_at_ms));
      body.append(row);
    });
    table.append(body);
    place.replaceChildren(table);
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const job = document.getElementById("job-live");
  if (job) followJob(job);
  const log = document.getElementById("log");
  if (log && log.dataset.complete !== "yes") followLog(log);
  const jobs = document.getElementById("jobs-live");
  if (jobs) followJobs(jobs);
});
