// The TunePlane console's only script: live updates of a Job page from its server-sent events.
// The pages work without it (every action is a plain form); this only saves a reload.
"use strict";

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
    if (["succeeded", "failed", "aborted", "cancelled"].includes(job.state)) {
      const form = document.getElementById("cancel-form");
      if (form) form.remove();
      events.close();
    }
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const holder = document.getElementById("job-live");
  if (holder) followJob(holder);
});
