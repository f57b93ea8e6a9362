// Live job progress: poll the job's JSON while it is queued or running, update the page in
// place (textContent only, so output is never parsed as HTML), the Ring panel included, stop
// when it finishes.
// Sizes come from data attributes and are set here: the pages carry no inline style, which
// the Content-Security-Policy forbids.
(function () {
  "use strict";
  document.querySelectorAll("[data-height]").forEach(function (el) {
    el.style.height = el.dataset.height + "%";
  });
  document.querySelectorAll("[data-width]").forEach(function (el) {
    el.style.width = el.dataset.width + "%";
  });
  var root = document.getElementById("job");
  if (!root) return;
  var url = root.dataset.progressUrl;
  var maxTokens = parseInt(root.dataset.maxTokens, 10) || 0;
  var finished = ["done", "failed", "cancelled"];

  function setText(id, value) {
    var el = document.getElementById(id);
    if (el && el.textContent !== value) el.textContent = value;
  }
  function fixed(value, digits) {
    return value === null || value === undefined ? "—" : Number(value).toFixed(digits);
  }
  function when(iso) {
    return iso.replace("T", " ").replace(/\.\d+/, "").replace("Z", " UTC");
  }
  var ringDrawn = null; // the Ring panel's stages as last drawn, as JSON
  function renderRing(ring) {
    var list = document.getElementById("job-ring");
    if (!ring || !list) return;
    var stages = JSON.stringify(ring.stages);
    if (stages !== ringDrawn) {
      ringDrawn = stages;
      list.textContent = "";
      ring.stages.forEach(function (stage) {
        var item = document.createElement("li");
        var role = document.createElement("b");
        role.textContent = stage.role;
        var detail = document.createElement("span");
        detail.className = "muted";
        detail.textContent = "layers " + stage.layers + (stage.geo ? " · " + stage.geo : "");
        item.appendChild(role);
        item.appendChild(document.createTextNode(" " + stage.host + " "));
        item.appendChild(detail);
        list.appendChild(item);
      });
    }
    list.hidden = ring.stages.length === 0;
    var record = document.getElementById("job-ring-record");
    if (record) {
      record.hidden = !ring.record_url;
      if (ring.record_url) record.setAttribute("href", ring.record_url);
    }
    var empty = document.getElementById("job-ring-empty");
    if (empty) { empty.hidden = !ring.empty; setText("job-ring-empty", ring.empty || ""); }
  }
  function render(job) {
    root.dataset.status = job.status;
    var badge = document.querySelector("#job-status .badge");
    if (badge) { badge.textContent = job.status; badge.className = "badge badge-" + job.status; }
    setText("stat-tokens", String(job.generated_tokens));
    setText("stat-toks", fixed(job.tok_s, 1));
    setText("stat-rounds", String(job.rounds));
    setText("stat-per-round", fixed(job.tokens_per_round, 2));
    if (job.reply) {  // gpt-oss: its reasoning and its answer apart
      setText("job-reasoning", job.reply.reasoning);
      setText("job-output", job.reply.content);
      var calls = document.getElementById("job-calls");  // its calls of the chat's functions
      if (calls) {
        var lines = (job.reply.calls || []).map(function (c) { return c.name + "(" + c.arguments + ")"; });
        calls.hidden = lines.length === 0;
        setText("job-calls-text", lines.join("\n"));
      }
    } else {
      setText("job-output", job.output_text || "");
    }
    var strip = document.getElementById("rounds-strip");
    var rounds = job.accepted_drafts || [];
    if (strip && strip.dataset.rounds !== String(rounds.length)) {
      strip.dataset.rounds = String(rounds.length);
      var k = parseInt(strip.dataset.k, 10) || 1;
      strip.textContent = "";
      rounds.slice(-80).forEach(function (a) {
        var span = document.createElement("span");
        span.style.height = (100 * a / k).toFixed(1) + "%";
        strip.appendChild(span);
      });
    }
    var bar = document.getElementById("progress-bar");
    if (bar && maxTokens) bar.style.width = (100 * job.generated_tokens / maxTokens).toFixed(1) + "%";
    var waiting = document.getElementById("job-waiting");
    if (waiting) waiting.hidden = Boolean(job.output_text) || finished.indexOf(job.status) >= 0;
    var line = document.getElementById("job-queue");
    if (line) {
      line.hidden = !job.queue;
      if (job.queue) {
        setText("job-queue-position", String(job.queue.position));
        setText("job-queue-size", String(job.queue.queued));
      }
    }
    var room = document.getElementById("job-room");
    if (room) {
      var wait = job.waiting_for_room;
      room.hidden = !wait;
      if (wait) {
        setText("job-room-host", wait.host);
        setText("job-room-used", String(wait.used));
        setText("job-room-budget", String(wait.budget));
        setText("job-room-need", String(wait.need));
      }
    }
    var error = document.getElementById("job-error");
    if (error) { error.hidden = !job.error; setText("job-error-text", job.error || ""); }
    var cancel = document.getElementById("cancel-form");
    if (cancel) cancel.hidden = finished.indexOf(job.status) >= 0;
    if (job.started_at) setText("job-started", when(job.started_at));
    if (job.finished_at) setText("job-finished", when(job.finished_at));
    renderRing(job.ring);
  }
  function poll() {
    fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" })
      .then(function (r) { return r.ok ? r.json() : null; })
      .then(function (job) {
        if (job) render(job);
        if (!job || finished.indexOf(job.status) < 0) setTimeout(poll, 1000);
      })
      .catch(function () { setTimeout(poll, 3000); });
  }
  if (finished.indexOf(root.dataset.status) < 0) poll();
})();
