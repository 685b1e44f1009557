// Orbit API reference (ReDoc): the OpenAPI document is embedded in the page (README "Security").
window.addEventListener("DOMContentLoaded", function () {
  var spec = JSON.parse(document.getElementById("openapi").textContent);
  Redoc.init(spec, { disableSearch: false }, document.getElementById("redoc"));
});
