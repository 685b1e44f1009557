// Accessibility: the search overlay is a dialog; give it a name (axe-core "aria-dialog-name").
document.querySelectorAll(".md-search[role=dialog]").forEach((dialog) => {
  if (!dialog.hasAttribute("aria-label")) dialog.setAttribute("aria-label", "Search the documentation");
});
