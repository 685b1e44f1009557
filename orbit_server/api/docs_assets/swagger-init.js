// Orbit API reference (Swagger UI): the OpenAPI document is embedded in the page, so the
// page needs no request of its own; "Try it out" is off (the page runs in a sandbox without
// the server's origin, README "Security").
window.addEventListener("DOMContentLoaded", function () {
  var spec = JSON.parse(document.getElementById("openapi").textContent);
  window.ui = SwaggerUIBundle({
    spec: spec,
    dom_id: "#swagger-ui",
    deepLinking: true,
    supportedSubmitMethods: [],
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
    layout: "BaseLayout",
  });
});
