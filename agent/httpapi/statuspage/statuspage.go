// Package statuspage is the admin endpoint's status page: one HTML, one
// JavaScript and one CSS file, embedded in the binary, that read the admin
// JSON (/v1/admin/status, /v1/admin/jobs) every few seconds and draw the
// mesh, the queues, the data plane, the Store and a Gantt chart of the
// recent jobs' stages. It loads nothing from elsewhere (a Content Security
// Policy of 'self' says so to the browser), so it works offline. Its files
// carry no data and are served without the admin token; the page asks for
// the token when the data reads answer 401 and sends it as a bearer header.
// Only agent/httpapi mounts it.
package statuspage

import (
	"embed"
	"io/fs"
	"net/http"
)

//go:embed assets
var assets embed.FS

// Handler serves the page's files: "/" is the page, "/app.js" and
// "/style.css" its script and style. Mount it under a prefix with
// http.StripPrefix.
func Handler() http.Handler {
	sub, err := fs.Sub(assets, "assets")
	if err != nil {
		panic("statuspage: " + err.Error()) // the directory is embedded above
	}
	files := http.FileServerFS(sub)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		// Nothing but this origin: no CDN, no inline script, and the
		// data reads go to the admin endpoint that served the page.
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-cache") // a new binary's page is picked up at once
		files.ServeHTTP(w, r)
	})
}
