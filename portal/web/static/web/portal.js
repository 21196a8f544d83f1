/* Batchery portal: small behaviours on top of server-rendered pages (htmx does the live updates). */
(function () {
  "use strict";

  /* ---- forms: confirm dangerous actions, auto-submit the tenant switcher ---- */

  document.addEventListener("submit", function (event) {
    const message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) {
      event.preventDefault();
    }
  });

  document.addEventListener("change", function (event) {
    const target = event.target;
    if (target.matches("[data-autosubmit]")) {
      target.form.requestSubmit();
    }
    if (target.matches("[data-model-select]")) {
      showModel(target.value);
    }
    if (target.matches(".dropzone input[type=file]")) {
      showChosenFile(target);
    }
  });

  /* ---- submit page: the drop zone and the chosen model's details ---- */

  function showChosenFile(input) {
    const zone = input.closest(".dropzone");
    const file = input.files && input.files[0];
    zone.classList.toggle("has-file", Boolean(file));
    zone.querySelector(".chosen").textContent = file ? file.name + " · " + formatBytes(file.size) : "";
  }

  function formatBytes(bytes) {
    if (bytes < 1024) return bytes + " B";
    if (bytes < 1024 * 1024) return (bytes / 1024).toFixed(1) + " KB";
    return (bytes / 1024 / 1024).toFixed(1) + " MB";
  }

  function setUpDropzone(zone) {
    const input = zone.querySelector("input[type=file]");
    ["dragenter", "dragover"].forEach(function (name) {
      zone.addEventListener(name, function (event) {
        event.preventDefault();
        zone.classList.add("dragging");
      });
    });
    ["dragleave", "dragend"].forEach(function (name) {
      zone.addEventListener(name, function () {
        zone.classList.remove("dragging");
      });
    });
    zone.addEventListener("drop", function (event) {
      event.preventDefault();
      zone.classList.remove("dragging");
      if (event.dataTransfer && event.dataTransfer.files.length) {
        input.files = event.dataTransfer.files;
        showChosenFile(input);
      }
    });
  }

  function showModel(pk) {
    document.querySelectorAll("[data-model-info]").forEach(function (panel) {
      panel.hidden = panel.getAttribute("data-model-info") !== pk;
    });
  }

  /* ---- job page: records per second, charted from the progress samples each poll brings ---- */

  const WINDOW = 3; // rate over the last few samples, so one slow poll does not make a spike
  const MAX_POINTS = 240;
  const charts = new Map();

  function chartState(jobId) {
    if (!charts.has(jobId)) {
      charts.set(jobId, { samples: [], points: [] });
    }
    return charts.get(jobId);
  }

  function sampleProgress() {
    const bar = document.querySelector("[data-job-progress]");
    const chart = document.getElementById("throughput-chart");
    if (!bar || !chart) return;
    const state = chartState(bar.dataset.job);
    const history = JSON.parse(bar.dataset.history || "[]");
    if (state.samples.length === 0 && history.length) {
      // The job ended before this page was opened: chart its run from the shards' timings.
      state.points = history;
      state.label = "peak";
    } else if (bar.dataset.active === "1" || state.samples.length) {
      const sample = { at: Number(bar.dataset.at), done: Number(bar.dataset.done) };
      const last = state.samples[state.samples.length - 1];
      if (!last || sample.at > last.at) {
        state.samples.push(sample);
        if (state.samples.length > 1) {
          const from = state.samples[Math.max(0, state.samples.length - 1 - WINDOW)];
          const seconds = sample.at - from.at;
          const rate = seconds > 0 ? Math.max(0, (sample.done - from.done) / seconds) : 0;
          state.points.push([sample.at - state.samples[0].at, rate]);
          if (state.points.length > MAX_POINTS) state.points.shift();
        }
      }
      state.label = bar.dataset.active === "1" ? "now" : "last";
    }
    drawChart(chart, state);
  }

  function niceMax(value) {
    if (value <= 0) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    const steps = [1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10];
    for (let i = 0; i < steps.length; i += 1) {
      if (value <= steps[i] * power) return steps[i] * power;
    }
    return 10 * power;
  }

  function formatRate(value) {
    if (value >= 100) return Math.round(value).toLocaleString();
    return value >= 10 || Number.isInteger(value) ? value.toFixed(0) : value.toFixed(1);
  }

  function svgElement(name, attributes, text) {
    const element = document.createElementNS("http://www.w3.org/2000/svg", name);
    Object.keys(attributes).forEach(function (key) {
      element.setAttribute(key, attributes[key]);
    });
    if (text !== undefined) element.textContent = text;
    return element;
  }

  function drawChart(chart, state) {
    const points = state.points;
    const svg = chart.querySelector("svg");
    const now = document.getElementById("throughput-now");
    chart.querySelector(".chart-empty").hidden = points.length > 1;
    svg.replaceChildren();
    if (points.length < 2) return;
    // Draw in the element's own pixels, so text is not stretched with the plot.
    const width = Math.max(svg.clientWidth, 200);
    const height = Math.max(svg.clientHeight, 100);
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    const left = 40;
    const right = 10;
    const top = 8;
    const bottom = 20;
    const minX = points[0][0];
    const spanX = Math.max(points[points.length - 1][0] - minX, 1);
    const peak = Math.max.apply(null, points.map(function (p) { return p[1]; }));
    const maxY = niceMax(peak);
    const x = function (value) { return left + ((value - minX) / spanX) * (width - left - right); };
    const y = function (value) { return top + (1 - value / maxY) * (height - top - bottom); };
    [0, 0.5, 1].forEach(function (fraction) {
      const value = maxY * fraction;
      svg.append(svgElement("line", { class: fraction ? "grid" : "axis", x1: left, x2: width - right, y1: y(value), y2: y(value) }));
      svg.append(svgElement("text", { x: left - 6, y: y(value) + 4, "text-anchor": "end" }, formatRate(value)));
    });
    svg.append(svgElement("text", { x: left, y: height - 4 }, Math.round(minX) + " s"));
    svg.append(svgElement("text", { x: width - right, y: height - 4, "text-anchor": "end" }, Math.round(minX + spanX) + " s"));
    const line = points.map(function (p) { return x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1); }).join(" ");
    const area = x(minX).toFixed(1) + "," + y(0) + " " + line + " " + x(minX + spanX).toFixed(1) + "," + y(0);
    svg.append(svgElement("polygon", { class: "area", points: area }));
    svg.append(svgElement("polyline", { class: "line", points: line }));
    if (now) {
      const shown = state.label === "peak" ? peak : points[points.length - 1][1];
      now.textContent = state.label + " " + formatRate(shown) + " records/s";
    }
  }

  /* ---- API keys: copy the key shown once ---- */

  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    const source = document.getElementById(button.getAttribute("data-copy"));
    navigator.clipboard.writeText(source.textContent.trim()).then(function () {
      button.textContent = "Copied";
    });
  });

  function init() {
    document.querySelectorAll(".dropzone").forEach(setUpDropzone);
    const select = document.querySelector("[data-model-select]");
    if (select) showModel(select.value);
    sampleProgress();
  }

  document.addEventListener("DOMContentLoaded", init);
  // After each poll of the job's live panel, take a new sample.
  document.addEventListener("htmx:afterSettle", sampleProgress);
})();
